"""The agent side of `engine=torch`: run this node's torch elastic agent while the job trains.

`TorchEngineHook` is an `AgentHooks` plug-in. While the node is TRAINING a job whose spec says
`engine=torch`, it keeps one launcher process (`launcher.py`: torch's `LocalElasticAgent` for
this node's slots on the etcd3 rendezvous) running; it stops it on cancel, drain and agent stop.

Why a child process rather than `LocalElasticAgent` on a thread of the agent:
* the agent stays torch-free (fast start, small memory; DESIGN.md's "agent (no torch)");
* torch's agent handles SIGTERM only on a main thread: in its own process, stopping it is its
  own tested path (workers get SIGTERM, the rendezvous stays open for the other nodes), with no
  way to wedge a thread that is blocked in a rendezvous;
* a crash of torch's agent cannot take the node daemon (lease, spot notices) down with it.
Kill chain: the launcher is forked by a supervisor thread that waits on it for its whole life and
asks for PDEATHSIG (see `lifeline.py`), and its workers do the same with the launcher, so SIGKILL
of the agent kills launcher and workers. A stop that does not finish in `stop_grace_s` gets
SIGKILL on the launcher's process group (workers follow through PDEATHSIG).

The rendezvous run id is `<job>-<spec mod revision>`: every node derives the same id from etcd,
and a new submission (a new spec revision) gets a fresh rendezvous. This module imports no torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticyolo.agent.hooks import AgentHooks
from elasticyolo.agent.state import NodeState, Transition
from elasticyolo.cluster.etcd import b64
from elasticyolo.cluster.keys import ACTIVE_JOB_STATES, JOB_DONE
from elasticyolo.data.staging_agent import data_ready
from elasticyolo.engines.torch.launcher import EXIT_CLOSED, LaunchSettings
from elasticyolo.log import get_logger

if TYPE_CHECKING:
    from elasticyolo.agent.daemon import Agent, JobView
    from elasticyolo.config import AgentConfig

log = get_logger("elasticyolo.torch.agent")

DEFAULT_SNAPSHOT_ROOT = "/var/tmp/elasticyolo"


def parse_conf(text: str) -> dict[str, Any]:
    """`k=v,k=v` (torchrun's --rdzv-conf syntax) with numbers converted."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = int(value)
        except ValueError:
            try:
                out[key.strip()] = float(value)
            except ValueError:
                out[key.strip()] = value.strip()
    return out


class LauncherProcess:
    """One launcher child, forked and reaped by its own supervisor thread (PDEATHSIG: the
    forking thread must outlive the child)."""

    def __init__(self, generation: int, cmd: list[str], env: dict[str, str], on_exit: Any) -> None:
        self.generation = generation
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None
        self.stop_requested_at: float | None = None
        self._started = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._supervise, args=(cmd, env, on_exit),
                                        name=f"torch-launcher-{generation}", daemon=True)
        self._thread.start()
        self._started.wait(30)
        if self._error is not None:
            raise self._error

    def _supervise(self, cmd: list[str], env: dict[str, str], on_exit: Any) -> None:
        try:
            self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._started.set()
            return
        self._started.set()
        self.returncode = self.proc.wait()
        self._done.set()
        on_exit()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def running(self) -> bool:
        return self.proc is not None and not self._done.is_set()

    def terminate(self) -> None:
        if self.running and self.stop_requested_at is None:
            self.stop_requested_at = time.monotonic()
            self._signal(signal.SIGTERM, group=False)

    def kill(self) -> None:
        self._signal(signal.SIGKILL, group=True)

    def _signal(self, sig: int, group: bool) -> None:
        if not self.running or self.proc is None:
            return
        try:
            if group:
                os.killpg(self.proc.pid, sig)  # its own session: launcher (+ anything left in it)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)


class TorchEngineHook(AgentHooks):
    def __init__(self, cfg: "AgentConfig", *, snapshot_root: str | None = None, stop_grace_s: float = 20.0,
                 retry_s: tuple[float, float] = (2.0, 60.0)) -> None:
        self.cfg = cfg
        self.snapshot_root = Path(snapshot_root or os.environ.get("ELASTICYOLO_SNAPSHOT_DIR") or DEFAULT_SNAPSHOT_ROOT)
        self.stop_grace_s = stop_grace_s
        self.retry_s = retry_s
        self.rdzv_conf = parse_conf(os.environ.get("ELASTICYOLO_TORCH_RDZV_CONF", ""))
        self.monitor_interval = float(os.environ.get("ELASTICYOLO_TORCH_MONITOR_INTERVAL", "1.0"))
        self._proc: LauncherProcess | None = None
        self._stopping: list[LauncherProcess] = []
        self._finished: set[int] = set()
        self._failures = 0
        self._retry_at = 0.0
        self._agent: "Agent | None" = None

    # ---- hook API --------------------------------------------------------------------------
    def on_start(self, agent: "Agent") -> None:
        self._agent = agent

    def on_job_change(self, agent: "Agent", job: "JobView") -> None:
        self._reconcile(agent)

    def on_state_change(self, agent: "Agent", transition: Transition) -> None:
        self._reconcile(agent)

    def on_tick(self, agent: "Agent") -> None:
        self._reconcile(agent)

    def on_drain(self, agent: "Agent", deadline: float) -> bool:
        self._stop_current("node draining")
        self._reap()
        return self._proc is None and not self._stopping

    def on_stop(self, agent: "Agent") -> None:
        self._stop_current("agent stopping")
        deadline = time.monotonic() + self.stop_grace_s
        for lp in list(self._stopping):
            if not lp.wait(max(0.0, deadline - time.monotonic())):
                log.warning("launcher ignored SIGTERM; killing its process group", pid=lp.pid)
                lp.kill()
                lp.wait(5)
        self._stopping.clear()

    # ---- reconciliation (agent loop thread) ------------------------------------------------
    def wanted(self, agent: "Agent") -> int | None:
        """The generation this node should be training, or None."""
        job = agent.job
        if agent.state is not NodeState.TRAINING or not job.active or job.spec is None:
            return None
        if job.spec.engine != "torch":
            return None
        if not data_ready(agent.record.extra):  # its s3:// dataset is still being staged
            return None
        return job.revision[0]

    def _reconcile(self, agent: "Agent") -> None:
        self._reap()
        gen = self.wanted(agent)
        if self._proc is not None and not self._proc.running:
            self._finished_run(agent, self._proc)
            self._proc = None
        if self._proc is not None and gen != self._proc.generation:
            self._stop_current("job cancelled or replaced" if gen is None else "job resubmitted")
        if gen is None or self._proc is not None or self._stopping or gen in self._finished:
            return
        if time.monotonic() < self._retry_at:
            return
        self._start(agent, gen)

    def _finished_run(self, agent: "Agent", lp: LauncherProcess) -> None:
        rc = lp.returncode
        if rc == 0 or rc == EXIT_CLOSED:
            log.info("torch job finished on this node", generation=lp.generation, rc=rc)
            self._finished.add(lp.generation)
            self._failures = 0
            if rc == 0:
                self._mark_done(agent, lp.generation)
            return
        self._failures += 1
        delay = min(self.retry_s[0] * 2 ** (self._failures - 1), self.retry_s[1])
        self._retry_at = time.monotonic() + delay
        log.warning("torch launcher exited; restarting", generation=lp.generation, rc=rc, retry_in_s=delay)

    def _mark_done(self, agent: "Agent", generation: int) -> None:
        """state=done, only if the spec is still this generation and the job still active."""
        keys = agent.keys
        try:
            got = agent.client.get(keys.state)
            if got is None or json.loads(got[0]).get("state") not in ACTIVE_JOB_STATES:
                return
            done = json.dumps({"state": JOB_DONE, "at": time.time(), "by": f"agent {self.cfg.node_id} (torch)"})
            agent.client.txn(
                [{"key": b64(keys.spec), "result": "EQUAL", "target": "MOD", "mod_revision": str(generation)},
                 {"key": b64(keys.state), "result": "EQUAL", "target": "MOD", "mod_revision": str(got[1])}],
                [{"request_put": {"key": b64(keys.state), "value": b64(done)}}], [])
        except Exception as exc:  # noqa: BLE001 - another node may write it; never fatal
            log.warning("could not mark the job done", error=str(exc))

    def _reap(self) -> None:
        now = time.monotonic()
        for lp in list(self._stopping):
            if not lp.running:
                self._stopping.remove(lp)
            elif lp.stop_requested_at is not None and now - lp.stop_requested_at > self.stop_grace_s:
                log.warning("launcher ignored SIGTERM; killing its process group", pid=lp.pid)
                lp.kill()

    def _stop_current(self, reason: str) -> None:
        lp, self._proc = self._proc, None
        if lp is None:
            return
        if lp.running:
            log.info("stopping torch launcher", reason=reason, pid=lp.pid, generation=lp.generation)
            lp.terminate()
            self._stopping.append(lp)

    # ---- start -----------------------------------------------------------------------------
    def snapshot_dir(self, job: str, generation: int) -> Path:
        return self.snapshot_root / self.cfg.node_id / job / str(generation)

    def _start(self, agent: "Agent", generation: int) -> None:
        spec = agent.job.spec
        assert spec is not None
        job_dir = self.snapshot_root / self.cfg.node_id / self.cfg.job
        for old in job_dir.glob("*") if job_dir.is_dir() else []:
            if old.name != str(generation):  # an older submission's snapshots: never restored
                shutil.rmtree(old, ignore_errors=True)
        snap = self.snapshot_dir(self.cfg.job, generation)
        snap.mkdir(parents=True, exist_ok=True)
        settings = LaunchSettings(
            run_id=f"{self.cfg.job}-{generation}", endpoints=",".join(self.cfg.etcd),
            key_prefix=agent.keys.rdzv.rstrip("/"), min_nodes=spec.min_nodes,
            max_nodes=spec.max_nodes or max(spec.min_nodes, 1024), nproc_per_node=self.cfg.slots,
            local_addr=self.cfg.addr, max_restarts=spec.reset_limit or 1000,
            monitor_interval=self.monitor_interval, rdzv_conf=self.rdzv_conf,
        )
        env = {**os.environ, **self._etcd_env(), "ELASTICYOLO_SPEC": spec.to_json(), "ELASTICYOLO_JOB": self.cfg.job,
               "ELASTICYOLO_NODE_ID": self.cfg.node_id, "ELASTICYOLO_SNAPSHOT_DIR": str(snap),
               "ELASTICYOLO_TORCH_LAUNCH": settings.to_json(), "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "elasticyolo.engines.torch.lifeline", "elasticyolo.engines.torch.launcher"]
        try:
            self._proc = LauncherProcess(generation, cmd, env, on_exit=agent.wake)
        except OSError as exc:
            self._failures += 1
            self._retry_at = time.monotonic() + self.retry_s[1]
            log.error("could not start the torch launcher", error=str(exc))
            return
        log.info("torch launcher started", pid=self._proc.pid, run_id=settings.run_id, slots=self.cfg.slots,
                 min_nodes=settings.min_nodes, max_nodes=settings.max_nodes)

    def _etcd_env(self) -> dict[str, str]:
        """TLS/auth for the rendezvous client, through the environment (never the command line)."""
        from elasticyolo.cluster.secrets import child_password_env

        c = self.cfg
        pairs = {"ELASTICYOLO_ETCD_CA_CERT": c.etcd_ca, "ELASTICYOLO_ETCD_CERT": c.etcd_cert,
                 "ELASTICYOLO_ETCD_KEY": c.etcd_key, "ELASTICYOLO_ETCD_USER": c.etcd_user}
        return {**{k: v for k, v in pairs.items() if v}, **child_password_env(c.etcd_password, c.etcd_password_file)}
