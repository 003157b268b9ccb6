"""Pre-warmed workers: one process per slot that has imported torch/Ultralytics/Horovod and
built the model and dataset index, waiting for its Horovod environment on stdin.

With stock `horovodrun` a joining host makes every running worker wait in the reset while the
newcomer imports and scans its dataset (7-12 s here). The agent keeps a warm process per free
slot and offers the slot to discovery (`ready_slots` in its node record) only once that process
is ready, so a join costs the running world only the rendezvous and the state sync.

Protocol (worker side `serve()`, agent side `PrewarmPool`): the process prints `READY_LINE`
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
from elasticyolo.engines.worker_env import ENV_SPEC, WorkerEnv
from elasticyolo.log import get_logger

READY_LINE = "ELASTICYOLO-PREWARM-READY"
MAX_FAILURES = 3


# ---- agent side ---------------------------------------------------------------------------
@dataclass
class WarmProcess:
    slot: int
    proc: subprocess.Popen  # type: ignore[type-arg]
    ready: threading.Event = field(default_factory=threading.Event)


class PrewarmPool:
    """At most one warm process per slot, spawned only for slots without a running worker."""

    def __init__(self, spec_json: str, slots: int, work_dir: Path, iface: str, **log_fields: Any) -> None:
        self.spec_json, self.slots, self.work_dir, self.iface = spec_json, slots, work_dir, iface
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

    def fill(self, running_slots: set[int] | None = None) -> None:
        """Spawn warm processes for free slots (agent loop thread: see engines/lifeline.py)."""
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
            env = {**os.environ, "HOROVOD_GLOO_IFACE": self.iface, "GLOO_SOCKET_IFNAME": self.iface}
            proc = spawn(worker_command("--prewarm-slot", str(slot)), env, WorkerEnv(spec_json=self.spec_json),
                         cwd=self.work_dir, stdin=subprocess.PIPE)
            w = WarmProcess(slot, proc)
            with self._lock:
                self.warm[slot] = w
            self.log.info("warming worker", slot=slot, pid=proc.pid)
            threading.Thread(target=self._pump, args=(w,), name=f"prewarm-{slot}", daemon=True).start()

    def ready_slots(self) -> set[int]:
        with self._lock:
            return {s for s, w in self.warm.items() if w.ready.is_set() and w.proc.poll() is None}

    def take(self, slot: int, env: dict[str, str]) -> subprocess.Popen | None:  # type: ignore[type-arg]
        """Hand the warm process for `slot` its Horovod environment; None if there is none
        ready for this spec (the launcher then starts a fresh worker)."""
        with self._lock:
            w = self.warm.get(slot)
            if w is None or not w.ready.is_set() or w.proc.poll() is not None:
                return None
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
                self.log.info("worker warm", slot=w.slot, pid=w.proc.pid)
                w.ready.set()
                return True
            return False

        pump_output(self.log.bind(slot=w.slot, pid=w.proc.pid), w.proc.stdout, on_line)


# ---- worker side --------------------------------------------------------------------------
def serve(spec: Any, slot: int, train: Callable[[Any], int]) -> int:
    """Build the training core, say READY, wait for the Horovod environment, then
    `train(core)` (the engine's worker entry, once the environment is complete)."""
    from elasticyolo.train.core import TrainCore, quiet_ultralytics

    quiet_ultralytics()
    core = TrainCore(spec, rank=0, world=1, local_rank=slot)
    core.loader.wait_ready(timeout=300)  # loader processes up before the slot is offered
    print(READY_LINE, flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0  # the agent closed the pool
    os.environ.update(json.loads(line))
    from elasticyolo.engines.lifeline import die_with_agent

    die_with_agent()  # the same agent, re-checked
    return train(core)
