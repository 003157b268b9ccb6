"""Worker launcher, one per agent: turns the leader's launch requests into worker processes.

The leader's driver writes `launch/<node>/<local_rank>` = {"id", "env", ...}; `reconcile()`
(called from the agent loop, which also owns the processes' parent thread — see pdeathsig.py)
starts a worker for every request it has not run yet and kills workers whose request was
withdrawn or replaced. A waiter thread per worker reports its exit code at `exit/<id>` (leased
by this node, so reports vanish with it) and streams the worker's output into the agent log.

Workers run in their own session so `killpg` takes the whole tree; they arm PR_SET_PDEATHSIG so
an agent SIGKILL takes them down too. Secrets (etcd password) reach them only through the
environment inherited from the agent, never through etcd or the command line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable

from elasticyolo.cluster.etcd import EtcdClient, EtcdError
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.engines.horovod import pdeathsig
from elasticyolo.engines.horovod.discovery import exits_prefix
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger

KILL_GRACE_S = 3.0


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


class Launcher:
    def __init__(self, client: EtcdClient, keys: JobKeys, node_id: str, addr: str,
                 lease: Callable[[], int], wake: Callable[[], None], work_dir: Path,
                 worker_cmd: list[str] | None = None, spawner: Any = None) -> None:
        self.client, self.keys, self.node_id = client, keys, node_id
        self.lease, self.wake = lease, wake
        self.work_dir = work_dir
        self.iface = interface_for(addr)
        self.log = get_logger("elasticyolo.launcher", node=node_id, job=keys.job)
        self.worker_cmd = worker_cmd or [sys.executable, "-m", "elasticyolo.cli", "worker"]
        self.spawner = spawner  # pre-warmed processes (prewarm.py), or None: spawn fresh
        self.workers: dict[int, Worker] = {}
        self.done_ids: set[str] = set()  # requests already run: never start one twice
        self._lock = threading.Lock()

    # ---- the reconcile step (agent loop thread) -----------------------------------------
    def reconcile(self, enabled: bool) -> None:
        """Make the running workers match the launch requests (all stopped when not enabled)."""
        wanted: dict[int, dict[str, Any]] = {}
        if enabled:
            prefix = self.keys.launch(self.node_id) + "/"
            for key, value, _ in self.client.get_prefix(prefix):
                try:
                    slot, req = int(key[len(prefix):]), json.loads(value)
                except ValueError:
                    continue
                if req.get("action") == "start" and req.get("id"):
                    wanted[slot] = req
        with self._lock:
            running = dict(self.workers)
        for slot, w in running.items():
            req = wanted.get(slot)
            if req is None or req["id"] != w.request_id:
                self._terminate(w, "request withdrawn" if req is None else "request replaced")
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
        env = {**os.environ, **{k: str(v) for k, v in req.get("env", {}).items()}}
        env.update({
            "HOROVOD_GLOO_IFACE": self.iface, "NCCL_SOCKET_IFNAME": self.iface, "GLOO_SOCKET_IFNAME": self.iface,
            "PYTHONUNBUFFERED": "1", pdeathsig.ENV: str(os.getpid()),
            "ELASTICYOLO_ETCD_PROGRESS": "1", "ELASTICYOLO_JOB": self.keys.job,
            "ELASTICYOLO_NODE_ID": self.node_id, "ELASTICYOLO_WORK_DIR": str(self.work_dir),
        })
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            proc = self.spawner.take(slot, env) if self.spawner is not None else None
            prewarmed = proc is not None
            if proc is None:
                proc = subprocess.Popen(self.worker_cmd, env=env, cwd=self.work_dir, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self.log.error("could not start worker", slot=slot, error=str(exc))
            self._report(req["id"], slot, 127)
            return
        w = Worker(req["id"], slot, proc)
        with self._lock:
            self.workers[slot] = w
        self.log.info("worker started", slot=slot, pid=proc.pid, request=req["id"],
                      rank=req.get("env", {}).get("HOROVOD_RANK"), prewarmed=prewarmed)
        if not prewarmed:  # a warm process's output is already pumped by the pool
            threading.Thread(target=pump_output, args=(self.log.bind(slot=slot, pid=proc.pid), proc.stdout),
                             name=f"worker-log-{slot}", daemon=True).start()
        threading.Thread(target=self._wait, args=(w,), name=f"worker-wait-{slot}", daemon=True).start()

    def _terminate(self, w: Worker, reason: str) -> None:
        if w.proc.poll() is not None:
            return
        now = time.monotonic()
        try:
            if w.kill_at is None:
                self.log.info("stopping worker", slot=w.slot, pid=w.proc.pid, reason=reason)
                w.kill_at = now
                os.killpg(w.proc.pid, signal.SIGTERM)
            elif now - w.kill_at > KILL_GRACE_S:
                os.killpg(w.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def kill_all_now(self) -> None:
        """SIGKILL every worker's process group (agent exit)."""
        with self._lock:
            running = list(self.workers.values())
        for w in running:
            try:
                os.killpg(w.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            w.proc.wait(10)

    def _wait(self, w: Worker) -> None:
        code = w.proc.wait()
        w.exit_code = code
        try:  # the rest of the group (helpers the worker started) goes too
            os.killpg(w.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.log.info("worker exited", slot=w.slot, pid=w.proc.pid, code=code, request=w.request_id,
                      seconds=round(time.monotonic() - w.started, 1))
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
                self.client.put(exits_prefix(self.keys) + request_id, report, lease=lease or None)
                return
            except (UnavailableError, EtcdError) as exc:
                if attempt == 0:
                    self.log.warning("could not report worker exit; retrying", error=str(exc))
                time.sleep(0.25)

    def running_slots(self) -> set[int]:
        with self._lock:
            return set(self.workers)


def pump_output(wlog: Any, stream: IO[bytes] | None, on_line: Callable[[str], bool] | None = None) -> None:
    """Re-log a worker's output line by line: its structlog JSON records keep their fields."""
    if stream is None:
        return
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip()
        if not line or (on_line is not None and on_line(line)):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if isinstance(rec, dict) and "event" in rec:
            level = str(rec.pop("level", "info"))
            event = rec.pop("event")
            rec.pop("timestamp", None)
            fields = {k: v for k, v in rec.items() if k not in ("node", "job", "slot", "pid")}
            getattr(wlog, level if level in ("debug", "info", "warning", "error") else "info")(
                f"worker: {event}", **fields)
        else:
            wlog.info("worker output", line=line[:2000])
    stream.close()
