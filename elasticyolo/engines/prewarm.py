"""Pre-warmed workers, for both engines: one process per slot that has imported torch,
Ultralytics and the engine, built the model, dataset index and loader processes, run one warm-up
pass (`TrainCore.warm_up`) and the engine's own preparation (Horovod: `worker.prepare_worker`),
waiting for its distributed environment on stdin.

Starting a worker costs seconds (imports, model, dataset scan: 4-12 s on 2 busy cores). Horovod:
the agent keeps a warm process per free slot and offers the slot to discovery (`ready_slots` in
its node record) only once it is ready, so a join costs the running world only the rendezvous and
the state sync. torch elastic restarts the world on every change: its launcher keeps one warm
process per slot and hands it the next round's environment instead of starting a new process
(`engines/torch/warm.py`).

Protocol (worker side `serve()`, pool side `PrewarmPool`): the process prints `READY_LINE`
when warm, then reads one JSON line (environment to add) and trains as a normal worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from elasticyolo.engines.spawn import kill_now, pump_output, spawn, worker_command
from elasticyolo.engines.worker_env import ENV_PREWARM_DELAY_S, ENV_SPEC, WorkerEnv
from elasticyolo.log import get_logger

READY_LINE = "ELASTICYOLO-PREWARM-READY"
# The pool's log events for a warm process (with its pid): `chaos replay` waits on them.
WARMING_EVENT, WARM_EVENT = "warming worker", "worker warm"
MAX_FAILURES = 3
ENV_PREWARM = "ELASTICYOLO_PREWARM"  # "0": start plain workers (no warm pool)


def prewarm_enabled() -> bool:
    return os.environ.get(ENV_PREWARM, "1") != "0"


# ---- agent side ---------------------------------------------------------------------------
@dataclass
class WarmProcess:
    slot: int
    proc: subprocess.Popen  # type: ignore[type-arg]
    ready: threading.Event = field(default_factory=threading.Event)


class PrewarmPool:
    """At most one warm process per slot, spawned only for slots without a running worker.
    `extra_env`: added to the warm processes' environment (the engine's network interface)."""

    def __init__(self, spec_json: str, slots: int, work_dir: Path, extra_env: dict[str, str] | None = None,
                 **log_fields: Any) -> None:
        self.spec_json, self.slots, self.work_dir = spec_json, slots, work_dir
        self.extra_env = dict(extra_env or {})
        self.log = get_logger("elasticyolo.prewarm", **log_fields)
        self.warm: dict[int, WarmProcess] = {}
        self.failures = 0  # warm processes that died before READY, in a row
        self._retry_at = 0.0
        self._lock = threading.Lock()

    @property
    def gave_up(self) -> bool:
        """Warm processes keep failing (bad spec, missing data): stop pre-warming and let plain
        workers start, so the failure reaches the driver and the job state."""
        return self.failures >= MAX_FAILURES

    def fill(self, running_slots: set[int] | None = None, delay_s: float = 0.0) -> None:
        """Spawn warm processes for free slots, from a thread that outlives them (the agent's
        loop thread, the launcher's main thread: see engines/lifeline.py). `delay_s`: they wait
        this long before importing anything heavy."""
        busy = running_slots if running_slots is not None else set()
        for slot in range(self.slots):
            with self._lock:
                w = self.warm.get(slot)
                if w is not None and w.proc.poll() is not None:
                    self.log.warning("warm worker died", slot=slot, code=w.proc.returncode)
                    del self.warm[slot]
                    if not w.ready.is_set():
                        self.failures += 1
                        self._retry_at = time.monotonic() + min(30.0, 2.0 ** self.failures)
                    w = None
            if w is not None or slot in busy or self.gave_up or time.monotonic() < self._retry_at:
                continue
            env = {**os.environ, **self.extra_env, ENV_PREWARM_DELAY_S: str(delay_s)}
            proc = spawn(worker_command("--prewarm-slot", str(slot)), env, WorkerEnv(spec_json=self.spec_json),
                         cwd=self.work_dir, stdin=subprocess.PIPE)
            w = WarmProcess(slot, proc)
            with self._lock:
                self.warm[slot] = w
            self.log.info(WARMING_EVENT, slot=slot, pid=proc.pid)
            threading.Thread(target=self._pump, args=(w,), name=f"prewarm-{slot}", daemon=True).start()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until every slot's process is warm (False: one died or it took too long)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            procs = list(self.warm.values())
        for w in procs:
            while not w.ready.wait(0.1):
                if w.proc.poll() is not None or time.monotonic() > deadline:
                    return False
        return len(procs) == self.slots

    def ready_slots(self) -> set[int]:
        with self._lock:
            return {s for s, w in self.warm.items() if w.ready.is_set() and w.proc.poll() is None}

    def take(self, slot: int, env: dict[str, str], ready_only: bool = True) -> subprocess.Popen | None:  # type: ignore[type-arg]
        """Hand the warm process for `slot` its environment; None if there is none for this spec
        (the caller then starts a fresh worker). `ready_only=False`: also one still warming up,
        which trains as soon as it is warm (sooner than a fresh process would)."""
        with self._lock:
            w = self.warm.get(slot)
            if w is None or w.proc.poll() is not None or (ready_only and not w.ready.is_set()):
                return None
            if w.ready.is_set():
                self.failures = 0
            if env.get(ENV_SPEC) != self.spec_json:
                return None
            del self.warm[slot]
        assert w.proc.stdin is not None
        try:
            w.proc.stdin.write((json.dumps(env) + "\n").encode())
            w.proc.stdin.close()
        except OSError:
            return None
        return w.proc

    def close(self) -> None:
        with self._lock:
            procs = list(self.warm.values())
            self.warm.clear()
        for w in procs:
            kill_now(w.proc)

    def _pump(self, w: WarmProcess) -> None:
        def on_line(line: str) -> bool:
            if line.strip() == READY_LINE:
                self.log.info(WARM_EVENT, slot=w.slot, pid=w.proc.pid)
                w.ready.set()
                return True
            return False

        pump_output(self.log.bind(slot=w.slot, pid=w.proc.pid), w.proc.stdout, on_line)


# ---- worker side --------------------------------------------------------------------------
def serve(spec: Any, slot: int, train: Callable[[Any], int], work_dir: str | os.PathLike[str] | None = None,
          prepare: Callable[[Any], Any] | None = None) -> int:
    """Build the training core, say READY, wait for the engine's environment, then
    `train(core)` (the engine's worker entry, once the environment is complete). `prepare(core)`:
    the engine's own work that needs no environment, done before READY; `train` then gets what
    it returns instead of the core."""
    from elasticyolo.train.core import TrainCore, quiet_ultralytics

    quiet_ultralytics()
    core = TrainCore(spec, rank=0, world=1, local_rank=slot, work_dir=work_dir)
    core.warm_up()  # its first step would otherwise stall the world it joins
    ready = prepare(core) if prepare is not None else core
    core.loader.wait_ready(timeout=300)  # loader processes up before the slot is offered
    print(READY_LINE, flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0  # the agent closed the pool
    os.environ.update(json.loads(line))
    from elasticyolo.engines.lifeline import die_with_agent

    die_with_agent()  # the same agent, re-checked
    return train(ready)
