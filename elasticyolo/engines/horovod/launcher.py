"""Worker launcher, one per agent: turns the leader's launch requests into worker processes.

The leader's driver writes `launch/<node>/<local_rank>` = {"action": "start", "id", "env", ...};
`reconcile()` (called from the agent loop, which also owns the processes' parent thread — see
worker_runtime/lifeline.py) starts a worker for every request it has not run yet and kills workers whose
request was withdrawn (the driver wrote {"action": "stop", "id"} for it) or replaced (a request
with another id). A request that is merely gone (it is leased by the leader, so a leader whose
lease lapsed takes its requests along) stops nothing: only a driver decides that a worker leaves
the world, and the next leader's driver replaces or withdraws the request. A waiter thread per worker reports its exit code at `exit/<id>` (leased
by this node, so reports vanish with it) and streams the worker's output into the agent log.
A worker that failed left its reason in its directory: it is published before the exit is
reported (`worker_runtime/worker_errors.py`), so a job the driver fails for that exit carries it.

Workers start through `worker_runtime/spawn.py` (own session, so `killpg` takes the whole tree; they die
with the agent, `worker_runtime/lifeline.py`). Secrets (etcd password) reach them only through their
environment (`worker_runtime/worker_env.py`), never through etcd or the command line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from elasticyolo.cluster.etcd import EtcdClient, EtcdError
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger
from elasticyolo.worker_runtime.spawn import KILL_GRACE_S, kill_now, pump_output, signal_group, spawn, worker_command
from elasticyolo.worker_runtime.worker_env import WorkerEnv
from elasticyolo.worker_runtime.worker_errors import WorkerErrors


def interface_for(addr: str) -> str:
    """The network interface holding `addr` (Gloo and Horovod's notification service use it)."""
    import psutil

    override = os.environ.get("ELASTICYOLO_GLOO_IFACE")
    if override:
        return override
    try:
        import socket

        ip = socket.gethostbyname(addr)
    except OSError:
        ip = addr
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            return name
    return "lo" if ip.startswith("127.") else next(iter(psutil.net_if_addrs()), "lo")


@dataclass
class Worker:
    request_id: str
    slot: int
    proc: subprocess.Popen  # type: ignore[type-arg]
    started: float = field(default_factory=time.monotonic)
    kill_at: float | None = None  # when a SIGTERM was sent
    exit_code: int | None = None
    work_dir: Path | None = None  # its directory (that of the submission it was started for)
    generation: int | None = None


class Launcher:
    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str, addr: str,
                 lease: Callable[[], int], wake: Callable[[], None], worker_env: WorkerEnv,
                 work_dir: Path | None = None, worker_cmd: list[str] | None = None, spawner: Any = None) -> None:
        self.client, self.keys, self.node_id = client, keys, node_id
        self.lease, self.wake = lease, wake
        self.worker_env = worker_env  # etcd, job and node for the workers' environment
        self.work_dir = work_dir  # node_work_dir() of the current submission (set by the node plug-in)
        self.iface = interface_for(addr)
        self.log = get_logger("elasticyolo.launcher", node=node_id, job=keys.job)
        self.worker_cmd = worker_cmd or worker_command()
        self.spawner = spawner  # pre-warmed processes (prewarm.py), or None: spawn fresh
        self.workers: dict[int, Worker] = {}
        self.errors = WorkerErrors(client, keys, node_id, self.log)
        self.done_ids: set[str] = set()  # requests already run: never start one twice
        self._lock = threading.Lock()

    # ---- the reconcile step (agent loop thread) -----------------------------------------
    def reconcile(self, enabled: bool) -> None:
        """Make the running workers match the launch requests (all stopped when not enabled)."""
        wanted: dict[int, dict[str, Any]] = {}
        withdrawn: dict[int, str] = {}  # slot -> the request id its driver stopped
        if enabled:
            prefix = self.keys.launch(self.node_id)
            for key, value, _ in self.client.get_prefix(prefix):
                try:
                    slot, req = int(key[len(prefix):]), json.loads(value)
                except ValueError:
                    continue
                if req.get("action") == "start" and req.get("id"):
                    wanted[slot] = req
                elif req.get("action") == "stop" and req.get("id"):
                    withdrawn[slot] = str(req["id"])
        with self._lock:
            running = dict(self.workers)
        for slot, w in running.items():
            if not enabled:
                self._terminate(w, "job inactive or node leaving")
                continue
            req = wanted.get(slot)
            if req is not None and req["id"] != w.request_id:
                self._terminate(w, "request replaced")
            elif req is None and withdrawn.get(slot) == w.request_id:
                self._terminate(w, "request withdrawn")
        for slot, req in wanted.items():
            if req["id"] in self.done_ids:
                continue
            with self._lock:
                busy = slot in self.workers
            if not busy:
                self._start(slot, req)

    def stop_all(self, reason: str) -> bool:
        """Kill every worker (SIGTERM, then SIGKILL after a grace period). True when none is left."""
        with self._lock:
            running = list(self.workers.values())
        for w in running:
            self._terminate(w, reason)
        return not running

    def running(self) -> int:
        with self._lock:
            return len(self.workers)

    # ---- processes ----------------------------------------------------------------------
    def _start(self, slot: int, req: dict[str, Any]) -> None:
        self.done_ids.add(req["id"])
        assert self.work_dir is not None
        # The driver's request (Horovod's env, spec, term, restore) + this node's part.
        env = {**os.environ, **{k: str(v) for k, v in req.get("env", {}).items()}, **self.iface_env()}
        mine = replace(self.worker_env, worker_dir=str(self.work_dir))
        try:
            proc = self.spawner.take(slot, {**env, **mine.to_env()}) if self.spawner is not None else None
            prewarmed = proc is not None
            if proc is None:
                proc = spawn(self.worker_cmd, env, mine, cwd=self.work_dir)
        except OSError as exc:
            self.log.error("could not start worker", slot=slot, error=str(exc))
            self._report(req["id"], slot, 127)
            return
        w = Worker(req["id"], slot, proc, work_dir=self.work_dir, generation=self.worker_env.generation)
        with self._lock:
            self.workers[slot] = w
        self.log.info("worker started", slot=slot, pid=proc.pid, request=req["id"],
                      rank=req.get("env", {}).get("HOROVOD_RANK"), prewarmed=prewarmed)
        if not prewarmed:  # a warm process's output is already pumped by the pool
            threading.Thread(target=pump_output, args=(self.log.bind(slot=slot, pid=proc.pid), proc.stdout),
                             name=f"worker-log-{slot}", daemon=True).start()
        threading.Thread(target=self._wait, args=(w,), name=f"worker-wait-{slot}", daemon=True).start()

    def iface_env(self) -> dict[str, str]:
        """Gloo/NCCL/Horovod on the interface of this node's advertised address."""
        return {"HOROVOD_GLOO_IFACE": self.iface, "NCCL_SOCKET_IFNAME": self.iface, "GLOO_SOCKET_IFNAME": self.iface}

    def _terminate(self, w: Worker, reason: str) -> None:
        if w.proc.poll() is not None:
            return
        now = time.monotonic()
        if w.kill_at is None:
            self.log.info("stopping worker", slot=w.slot, pid=w.proc.pid, reason=reason)
            w.kill_at = now
            signal_group(w.proc, signal.SIGTERM)
        elif now - w.kill_at > KILL_GRACE_S:
            signal_group(w.proc, signal.SIGKILL)

    def kill_all_now(self) -> None:
        """SIGKILL every worker's process group (agent exit)."""
        with self._lock:
            running = list(self.workers.values())
        for w in running:
            w.kill_at = w.kill_at or time.monotonic()  # asked to die: not a failure of its own
            kill_now(w.proc)

    def _wait(self, w: Worker) -> None:
        code = w.proc.wait()
        w.exit_code = code
        signal_group(w.proc, signal.SIGKILL)  # the rest of the group (helpers the worker started) goes too
        self.log.info("worker exited", slot=w.slot, pid=w.proc.pid, code=code, request=w.request_id,
                      seconds=round(time.monotonic() - w.started, 1))
        if code != 0:
            self.errors.publish_pending(w.work_dir, w.generation, None if w.kill_at is not None else
                                        {"pid": w.proc.pid, "slot": w.slot, "code": code})
        self._report(w.request_id, w.slot, code)
        with self._lock:
            if self.workers.get(w.slot) is w:
                del self.workers[w.slot]
        self.wake()

    def _report(self, request_id: str, slot: int, code: int) -> None:
        report = json.dumps({"code": code, "node": self.node_id, "slot": slot, "at": time.time()})
        for attempt in range(20):
            try:
                lease = self.lease()
                self.client.put(self.keys.exit(request_id), report, lease=lease or None)
                return
            except (UnavailableError, EtcdError) as exc:
                if attempt == 0:
                    self.log.warning("could not report worker exit; retrying", error=str(exc))
                time.sleep(0.25)

    def running_slots(self) -> set[int]:
        with self._lock:
            return set(self.workers)

