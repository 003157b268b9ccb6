"""One node's torch engine launcher: keeps this node's workers (one per slot) running for one
submission, each started warm (`worker_runtime/prewarm.py`).

Started by the agent's torch node (`node.py`) as `python -m elasticyolo.engines.torch.launcher`
with its settings in the worker environment (`engine_config`: `LaunchSettings` as JSON). It dies
with the agent, and its workers die with it (`worker_runtime/lifeline.py`).

Workers live through world changes (`worker.py`): a worker process is started only where one
died. When a worker exits, the launcher deletes its member record at once, so the coordinator
leaves it out of the next world without waiting for any timeout; a worker that failed is started
again (from a warm process) after a back-off. SIGTERM asks every worker to leave at its next
commit (the node drains or the job stops); the launcher exits once they have.

Exit codes (the workers' and the launcher's): 0 finished the job, one of them as rank 0 (which
wrote the final checkpoint and the run folder: the job ends when it exits); `EXIT_FINISHED_ELSEWHERE`
finished the job as other ranks (rank 0's node ends the job); 143 stopped by SIGTERM; 1 the
launcher failed.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from elasticyolo.log import get_logger
from elasticyolo.worker_runtime import worker_env
from elasticyolo.worker_runtime.lifeline import die_with_agent
from elasticyolo.worker_runtime.prewarm import PrewarmPool, preload_modules, prewarm_enabled
from elasticyolo.worker_runtime.spawn import pump_output, spawn, worker_command
from elasticyolo.worker_runtime.zygote import Zygote, zygote_enabled

log = get_logger("elasticyolo.torch.launcher")

EXIT_SIGTERM = 143
EXIT_FINISHED_ELSEWHERE = 3
POLL_S = 0.05  # how often the launcher looks at its workers


@dataclass
class LaunchSettings:
    slots: int
    warm_timeout_s: float = 300.0  # how long warm workers may take to start before plain ones are used
    retry_s: tuple[float, float] = (1.0, 30.0)  # back-off before restarting a failed worker (first, most)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "LaunchSettings":
        data = json.loads(text)
        if "retry_s" in data:
            data["retry_s"] = tuple(data["retry_s"])
        return cls(**data)


def start_warm_pool(settings: LaunchSettings, env: worker_env.WorkerEnv) -> PrewarmPool | None:
    """One warm worker per slot, started first thing, on the main thread before any other: this
    process forks the pool's zygote from itself (`Zygote.fork_here`) after importing what a worker
    needs, so the node imports torch once. Where forking fails, the pool spawns its zygote (or
    plain processes)."""
    if not prewarm_enabled() or not env.spec_json or not env.worker_dir:
        return None
    from elasticyolo.engines import registry
    from elasticyolo.spec import TrainSpec

    worker_modules = registry.get(TrainSpec.from_json(env.spec_json, "ELASTICYOLO_SPEC").engine).worker_modules
    zygote = None
    if zygote_enabled():
        try:
            zygote = Zygote.fork_here(preload_modules(worker_modules), node=env.node_id, job=env.job)
        except Exception as exc:  # noqa: BLE001 - a warm pool is an optimization; the pool falls back
            log.warning("could not fork a zygote from the launcher; the pool spawns one", error=str(exc))
    pool = PrewarmPool(env.spec_json, settings.slots, Path(env.worker_dir), zygote=zygote,
                       worker_modules=worker_modules, node=env.node_id, job=env.job)
    pool.fill()
    return pool


class Launcher:
    def __init__(self, settings: LaunchSettings, env: worker_env.WorkerEnv, pool: PrewarmPool | None) -> None:
        self.settings, self.env, self.pool = settings, env, pool
        self.workers: dict[int, Any] = {}  # slot -> its running process
        self.finished: dict[int, int] = {}  # slot -> its worker's exit code, for those that finished the job
        self.failures: dict[int, int] = {}
        self.retry_at: dict[int, float] = {}
        self.stopping = threading.Event()
        self._signalled: set[int] = set()  # pids already asked to leave
        connected = env.etcd_client(timeout=5.0)
        self.client, self.keys = connected if connected is not None else (None, None)

    # ---- workers -------------------------------------------------------------------------------
    def _slot_env(self, slot: int) -> dict[str, str]:
        return {"LOCAL_RANK": str(slot), "LOCAL_WORLD_SIZE": str(self.settings.slots)}

    def start(self, slot: int) -> None:
        proc = None
        if self.pool is not None and not self.pool.gave_up:
            self.pool.fill(running_slots=set(self.workers))
            # The spec goes with the slot's environment: a warm process is handed over only for
            # the spec it was built for.
            proc = self.pool.take(slot, {worker_env.ENV_SPEC: self.env.spec_json or "", **self._slot_env(slot)},
                                  ready_only=False)
        if proc is None:
            proc = spawn(worker_command(), {**os.environ, **self._slot_env(slot)}, cwd=self.env.worker_dir)
            threading.Thread(target=pump_output, args=(log.bind(slot=slot, pid=proc.pid), proc.stdout),
                             name=f"worker-{slot}-out", daemon=True).start()
        self.workers[slot] = proc
        log.info("worker started", slot=slot, pid=proc.pid)

    def _forget_member(self, slot: int) -> None:
        if self.client is None or self.keys is None or self.env.generation is None or self.env.node_id is None:
            return
        try:
            self.client.delete(self.keys.torch_member(self.env.generation, self.env.node_id, slot))
        except Exception as exc:  # noqa: BLE001 - the coordinator also drops the node when it goes
            log.warning("member record not deleted", slot=slot, error=str(exc))

    def _reap(self) -> None:
        for slot, proc in list(self.workers.items()):
            rc = proc.poll()
            if rc is None:
                continue
            del self.workers[slot]
            self._forget_member(slot)
            if rc in (0, EXIT_FINISHED_ELSEWHERE) and not self.stopping.is_set():
                log.info("worker finished", slot=slot, rank0=rc == 0)
                self.finished[slot] = rc
            elif not self.stopping.is_set():
                n = self.failures[slot] = self.failures.get(slot, 0) + 1
                first, most = self.settings.retry_s
                delay = min(first * 2 ** (n - 1), most)
                self.retry_at[slot] = time.monotonic() + delay
                log.warning("worker exited; starting another", slot=slot, rc=rc, retry_in_s=delay)

    def run(self) -> int:
        if self.pool is not None and not self.pool.wait_ready(self.settings.warm_timeout_s):
            # A bad spec or missing data: plain starts make the failure reach the job state.
            log.warning("warm workers did not start; starting plain workers", timeout_s=self.settings.warm_timeout_s)
            self.pool.close()
            self.pool = None
        for slot in range(self.settings.slots):
            self.start(slot)
        while True:
            self._reap()
            if self.stopping.is_set():
                for proc in self.workers.values():
                    if proc.pid not in self._signalled:
                        self._signalled.add(proc.pid)
                        _signal(proc, signal.SIGTERM)
                if not self.workers:
                    return EXIT_SIGTERM
            elif len(self.finished) == self.settings.slots:
                return 0 if 0 in self.finished.values() else EXIT_FINISHED_ELSEWHERE
            else:
                now = time.monotonic()
                for slot in range(self.settings.slots):
                    if slot not in self.workers and slot not in self.finished and now >= self.retry_at.get(slot, 0.0):
                        self.start(slot)
            self.stopping.wait(POLL_S)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _signal(proc: Any, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except (ProcessLookupError, OSError):
        pass


def main() -> None:
    die_with_agent()  # first, before anything heavy loads
    import setproctitle  # noqa: F401  (finds argv's memory while the environment is the original: zygote.py)

    from elasticyolo import log as logging_setup

    logging_setup.configure()
    env = worker_env.read()
    if not env.engine_config:
        print("elasticyolo torch launcher: no launch settings in the environment (started by an agent?)",
              file=sys.stderr)
        sys.exit(2)
    settings = LaunchSettings.from_json(env.engine_config)
    # Workers (started from this process) die with this process, not the agent.
    os.environ.update(replace(env, parent_pid=os.getpid()).to_env())
    launcher = Launcher(settings, env, start_warm_pool(settings, env))
    asked = [False]

    def on_sigterm(*_: Any) -> None:
        if not asked[0]:
            asked[0] = True
            log.info("stopping: workers leave at their next commit")
        launcher.stopping.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    try:
        code = launcher.run()
    except Exception as exc:  # noqa: BLE001
        log.error("torch launcher failed", error=str(exc))
        code = 1
    finally:
        launcher.close()
    sys.exit(code)


if __name__ == "__main__":
    main()
