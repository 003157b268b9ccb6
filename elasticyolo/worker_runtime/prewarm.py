"""Pre-warmed workers, for both engines: one process per slot that has imported torch,
Ultralytics and the engine, built the model, dataset index and loader processes, run one warm-up
pass (`TrainCore.warm_up`) and the engine's own preparation (Horovod: `worker.prepare_worker`),
waiting for its distributed environment on stdin.

Starting a worker costs seconds (imports, model, dataset scan: 4-12 s on 2 busy cores). Horovod:
the agent keeps a warm process per free slot and offers the slot to discovery (`ready_slots` in
its node record) only once it is ready, so a join costs the running world only the rendezvous and
the state sync. torch: the node's launcher starts each slot's worker from its warm process, and
again where one died (`engines/torch/launcher.py`).

Protocol (worker side `serve()`, pool side `PrewarmPool`): the process prints `READY_LINE`
when warm, then reads one JSON line (environment to add) and trains as a normal worker.

The pool forks its warm processes from a zygote (`worker_runtime/zygote.py`) that has done the imports
once, so a refill costs a node ~0.5 CPU-s instead of ~5; plain processes where it is off
(`ELASTICYOLO_ZYGOTE=0`) or has failed.
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

from elasticyolo.errors import UserError
from elasticyolo.log import get_logger
from elasticyolo.worker_runtime.spawn import child_env, kill_now, pump_output, spawn, worker_command
from elasticyolo.worker_runtime.worker_env import ENV_PARENT_PID, ENV_PREWARM_DELAY_S, ENV_SPEC, WorkerEnv
from elasticyolo.worker_runtime.zygote import PRELOAD, Zygote, ZygoteError, zygote_enabled

READY_LINE = "ELASTICYOLO-PREWARM-READY"
# The pool's log events for a warm process (with its pid): `chaos replay` waits on them.
WARMING_EVENT, WARM_EVENT = "warming worker", "worker warm"
MAX_FAILURES = 3
ENV_PREWARM = "ELASTICYOLO_PREWARM"  # "0": start plain workers (no warm pool)


def prewarm_enabled() -> bool:
    return os.environ.get(ENV_PREWARM, "1") != "0"


def preload_modules(worker_modules: tuple[str, ...]) -> tuple[str, ...]:
    """What a zygote imports for an engine's workers: every worker's, then the engine's
    (`Engine.worker_modules`)."""
    return (*PRELOAD, *worker_modules)


# ---- agent side ---------------------------------------------------------------------------
@dataclass
class WarmProcess:
    slot: int
    proc: Any  # subprocess.Popen or zygote.ForkedProcess; None while the zygote forks it
    ready: threading.Event = field(default_factory=threading.Event)
    failed: bool = False  # the zygote could not fork it

    def dead(self) -> bool:
        return self.failed or (self.proc is not None and self.proc.poll() is not None)


class PrewarmPool:
    """At most one warm process per slot, spawned only for slots without a running worker.
    `extra_env`: added to the warm processes' environment (the engine's network interface)."""

    def __init__(self, spec_json: str, slots: int, work_dir: Path, extra_env: dict[str, str] | None = None,
                 zygote: Zygote | None = None, worker_modules: tuple[str, ...] = (), **log_fields: Any) -> None:
        """`zygote`: one made by the owner (`Zygote.fork_here`); else the pool spawns its own, which
        imports `worker_modules` (the engine's)."""
        self.spec_json, self.slots, self.work_dir = spec_json, slots, work_dir
        self.worker_modules = worker_modules
        self.extra_env = dict(extra_env or {})
        self.log_fields = log_fields
        self.log = get_logger("elasticyolo.prewarm", **log_fields)
        self.warm: dict[int, WarmProcess] = {}
        self.failures = 0  # warm processes that died before READY, in a row
        self._retry_at = 0.0
        self._lock = threading.Lock()
        self._zygote: Zygote | None = zygote
        self._zygote_failed = zygote is None and not zygote_enabled()
        self._closed = False

    @property
    def gave_up(self) -> bool:
        """Warm processes keep failing (bad spec, missing data): stop pre-warming and let plain
        workers start, so the failure reaches the driver and the job state."""
        return self.failures >= MAX_FAILURES

    def fill(self, running_slots: set[int] | None = None, delay_s: float = 0.0) -> None:
        """Spawn warm processes for free slots, from a thread that outlives them (the agent's
        loop thread, the launcher's main thread: see worker_runtime/lifeline.py). `delay_s`: they wait
        this long before importing anything heavy."""
        busy = running_slots if running_slots is not None else set()
        for slot in range(self.slots):
            with self._lock:
                w = self.warm.get(slot)
                if w is not None and w.dead():
                    if not w.failed:
                        self.log.warning("warm worker died", slot=slot, code=w.proc.returncode)
                    del self.warm[slot]
                    if not w.ready.is_set() and not w.failed:
                        self.failures += 1
                        self._retry_at = time.monotonic() + min(30.0, 2.0 ** self.failures)
                    w = None
            if w is not None or slot in busy or self.gave_up or time.monotonic() < self._retry_at:
                continue
            env = {**os.environ, **self.extra_env, ENV_PREWARM_DELAY_S: str(delay_s)}
            zygote = self._zygote_for_fill()
            if zygote is not None:
                w = WarmProcess(slot, None)
                with self._lock:
                    self.warm[slot] = w
                threading.Thread(target=self._fork, args=(w, zygote, env), name=f"prewarm-{slot}",
                                 daemon=True).start()
                continue
            proc = spawn(worker_command("--prewarm-slot", str(slot)), env, WorkerEnv(spec_json=self.spec_json),
                         cwd=self.work_dir, stdin=subprocess.PIPE)
            w = WarmProcess(slot, proc)
            with self._lock:
                self.warm[slot] = w
            self.log.info(WARMING_EVENT, slot=slot, pid=proc.pid)
            threading.Thread(target=self._pump, args=(w,), name=f"prewarm-{slot}", daemon=True).start()

    def _zygote_for_fill(self) -> Zygote | None:
        """The zygote, started on first use from the filling thread (it must outlive the zygote,
        as for any spawn); None where it is off or has failed (plain processes then)."""
        if self._zygote_failed:
            return None
        if self._zygote is not None and not self._zygote.alive:
            self.log.warning("zygote gone; warm workers start as fresh processes", code=self._zygote.proc.poll())
            self._zygote_failed = True
            return None
        if self._zygote is None:
            try:
                self._zygote = Zygote(preload_modules(self.worker_modules), {**os.environ, **self.extra_env},
                                      WorkerEnv(spec_json=self.spec_json), cwd=self.work_dir, **self.log_fields)
            except (OSError, ValueError, UserError) as exc:
                self.log.warning("no zygote; warm workers start as fresh processes", error=str(exc))
                self._zygote_failed = True
                return None
        return self._zygote

    def _fork(self, w: WarmProcess, zygote: Zygote, env: dict[str, str]) -> None:
        cmd = worker_command("--prewarm-slot", str(w.slot))
        try:
            proc = zygote.fork(cmd[2], cmd[3:], child_env(env, WorkerEnv(spec_json=self.spec_json)), self.work_dir)
        except ZygoteError as exc:
            self.log.warning("zygote could not fork a warm worker; the next fill starts a fresh one",
                             slot=w.slot, error=str(exc))
            self._zygote_failed = True
            w.failed = True
            return
        with self._lock:
            w.proc = proc
            cancelled = self._closed or self.warm.get(w.slot) is not w
        if cancelled:
            kill_now(proc)
            return
        self.log.info(WARMING_EVENT, slot=w.slot, pid=proc.pid, forked=True)
        self._pump(w)

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until every slot's process is warm (False: one died or it took too long)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            procs = list(self.warm.values())
        for w in procs:
            while not w.ready.wait(0.1):
                if w.dead() or time.monotonic() > deadline:
                    return False
        return len(procs) == self.slots

    def ready_slots(self) -> set[int]:
        with self._lock:
            return {s for s, w in self.warm.items() if w.ready.is_set() and not w.dead()}

    def take(self, slot: int, env: dict[str, str], ready_only: bool = True) -> subprocess.Popen | None:  # type: ignore[type-arg]
        """Hand the warm process for `slot` its environment; None if there is none for this spec
        (the caller then starts a fresh worker). `ready_only=False`: also one still warming up,
        which trains as soon as it is warm (sooner than a fresh process would)."""
        with self._lock:
            w = self.warm.get(slot)
            if w is None or w.proc is None or w.dead() or (ready_only and not w.ready.is_set()):
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
            self._closed = True
            procs = [w.proc for w in self.warm.values() if w.proc is not None]
            self.warm.clear()
        for proc in procs:
            kill_now(proc)
        if self._zygote is not None:
            self._zygote.close()  # it exits once the workers it handed over have

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
    lifeline = os.environ.get(ENV_PARENT_PID)
    os.environ.update(json.loads(line))
    if lifeline is not None:  # who this process dies with is not the handing-over process's business
        os.environ[ENV_PARENT_PID] = lifeline
    from elasticyolo.worker_runtime.lifeline import die_with_agent

    die_with_agent()  # the same parent, re-checked
    return train(ready)
