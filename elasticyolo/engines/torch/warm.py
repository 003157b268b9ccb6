"""Warm worker starts for torch elastic: every round's workers are processes that were warm already.

torch elastic restarts the whole world on every membership change, and its agent starts a new
worker process each time: imports, model, dataset index and loader processes cost 3-4 s on 2 busy
cores, on every node, after every kill and every join. The launcher keeps one warm process per
slot (`worker_runtime/prewarm.py`, the same pool the Horovod engine uses) and torch's agent hands it the
round's environment instead of starting a process (one still warming up is handed it too: it
trains as soon as it is warm, sooner than a new process would). Everything else stays torch's: the warm
process is a child of the launcher in its own session, so torch's own monitoring (`poll`), its
stop (`killpg` SIGTERM, then SIGKILL) and its failure reports work on it unchanged.

How: torch's `SubprocessContext` gets its per-worker handler from the module attribute
`get_subprocess_handler` of `torch.distributed.elastic.multiprocessing.api`; `install()` points
that at `WarmStarts.handler` in this process only (the launcher). A handler whose slot has a
warm process writes the environment to it; otherwise it starts a process the stock way. The
replacement warm process is spawned right away from the same (main) thread, so it dies with the
launcher (PR_SET_PDEATHSIG follows the forking thread), but waits `refill_delay_s` before its
imports so it does not take the CPU from the round that is starting.
"""

from __future__ import annotations

import subprocess
from typing import Any

from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

from elasticyolo.log import get_logger
from elasticyolo.worker_runtime.prewarm import PrewarmPool

log = get_logger("elasticyolo.torch.warm")


class WarmStarts:
    def __init__(self, pool: PrewarmPool, refill_delay_s: float = 3.0) -> None:
        self.pool, self.refill_delay_s = pool, refill_delay_s
        self.handed = 0  # rounds' workers that were warm (for the log and tests)
        self.cold = 0

    def install(self) -> None:
        mp_api.get_subprocess_handler = self.handler  # type: ignore[assignment]

    def handler(self, entrypoint: str, args: tuple[Any, ...], env: dict[str, str], stdout: str | None,
                stderr: str | None, local_rank_id: int, numa_options: Any = None) -> SubprocessHandler:
        return _WarmHandler(self, entrypoint=entrypoint, args=args, env=env, stdout=stdout, stderr=stderr,
                            local_rank_id=local_rank_id, numa_options=numa_options)

    def take(self, slot: int, env: dict[str, str]) -> subprocess.Popen[bytes] | None:
        proc = self.pool.take(slot, env, ready_only=False)
        if proc is None:
            self.cold += 1
            log.info("no warm worker for this slot; starting one", slot=slot)
        else:
            self.handed += 1
            log.info("round handed to a warm worker", slot=slot, pid=proc.pid, rank=env.get("RANK"))
        self.pool.fill(delay_s=self.refill_delay_s)  # the next round's, from this (main) thread
        return proc


class _WarmHandler(SubprocessHandler):
    def __init__(self, starts: WarmStarts, **kwargs: Any) -> None:
        self._starts = starts
        super().__init__(**kwargs)

    def _popen(self, args: tuple[Any, ...], env: dict[str, str]) -> subprocess.Popen[Any]:
        # `env` is this process's environment plus torch's variables for the worker.
        proc = self._starts.take(self.local_rank_id, env)
        return proc if proc is not None else super()._popen(args, env)
