"""Plugs the Horovod engine into the agent (see agent/hooks.py): every agent runs a worker
`Launcher`; the leader also runs a `DriverRunner` while a horovod job is active.

Everything here runs on the agent loop thread and only starts/stops threads and processes, so
it never blocks the loop for long. etcd hiccups are logged and retried on the next tick.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticyolo.agent.hooks import AgentHooks
from elasticyolo.agent.state import NodeState
from elasticyolo.cluster.etcd import EtcdError
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger

if TYPE_CHECKING:
    from elasticyolo.agent.daemon import Agent
    from elasticyolo.engines.horovod.drain import HorovodDrain
    from elasticyolo.engines.horovod.driver import DriverRunner
    from elasticyolo.engines.horovod.launcher import Launcher
    from elasticyolo.engines.horovod.prewarm import PrewarmPool


def default_work_dir(job: str, node_id: str) -> Path:
    base = os.environ.get("ELASTICYOLO_WORK_DIR") or os.path.join(tempfile.gettempdir(), "elasticyolo")
    return Path(base) / job / node_id


class HorovodEngineHooks(AgentHooks):
    def __init__(self, prewarm: bool | None = None) -> None:
        self.launcher: "Launcher | None" = None
        self.runner: "DriverRunner | None" = None
        self.pool: "PrewarmPool | None" = None
        self.drain: "HorovodDrain | None" = None
        self._runner_key: tuple[int, int] | None = None  # (term, spec revision) the runner serves
        self._finished_key: tuple[int, int] | None = None
        self.prewarm = (os.environ.get("ELASTICYOLO_PREWARM", "1") != "0") if prewarm is None else prewarm
        self.log: Any = None

    # ---- lifecycle ----------------------------------------------------------------------
    def on_start(self, agent: "Agent") -> None:
        from elasticyolo.agent.daemon import make_client
        from elasticyolo.engines.horovod.launcher import Launcher

        cfg = agent.cfg
        self.log = get_logger("elasticyolo.horovod", node=cfg.node_id, job=cfg.job)
        self._export_etcd_env(agent)
        work_dir = default_work_dir(cfg.job, cfg.node_id)
        self.launcher = Launcher(make_client(cfg), agent.keys, cfg.node_id, cfg.addr,
                                 lease=lambda: agent.registration.lease_id, wake=agent.wake, work_dir=work_dir)

    def on_tick(self, agent: "Agent") -> None:
        job = agent.job
        horovod_job = job.active and job.spec is not None and job.spec.engine == "horovod"
        serving = agent.state in (NodeState.IDLE, NodeState.TRAINING)
        draining = agent.state is NodeState.DRAINING and self.drain is not None and self.drain.mode != "idle"
        try:
            self._manage_prewarm(agent, horovod_job and serving)
            if self.launcher is not None:
                # Draining: the worker keeps running until the world lets it go (drain.py); only a
                # withdrawn request (the driver stopped) stops it here.
                self.launcher.reconcile(horovod_job and (serving or draining))
        except (UnavailableError, EtcdError) as exc:
            self.log.warning("launcher could not read etcd; will retry", error=str(exc))
        if not draining:
            self._manage_driver(agent, horovod_job and serving and agent.is_leader)

    def on_lose_leadership(self, agent: "Agent", reason: str) -> None:
        self._stop_runner(f"lost leadership: {reason}")

    def before_drain(self, agent: "Agent") -> None:
        from elasticyolo.engines.horovod.drain import HorovodDrain

        self.drain = HorovodDrain(agent, self)
        try:
            self.drain.plan()
        except (UnavailableError, EtcdError) as exc:
            self.log.warning("could not plan the drain; leaving through a plain stop", error=str(exc))
            self.drain.mode = "idle"

    def keeps_leadership_while_draining(self, agent: "Agent") -> bool:
        return self.drain is not None and self.drain.mode == "handover" and self.runner is not None

    def on_drain(self, agent: "Agent", deadline: float) -> bool:
        self._stop_pool()
        if self.drain is None or self.drain.mode == "idle":
            self._stop_runner("draining")
            return self.launcher is None or self.launcher.stop_all("draining")
        done = self.drain.step(deadline)
        if done:
            self._stop_runner("drained")
        return done

    def on_stop(self, agent: "Agent") -> None:
        self._stop_runner("agent stopping")
        self._stop_pool()
        if self.launcher is not None:
            self.launcher.kill_all_now()

    # ---- driver (leader only) -----------------------------------------------------------
    def _manage_driver(self, agent: "Agent", want: bool) -> None:
        if not want:
            if self.runner is not None:
                self._stop_runner("job inactive or not leader")
            return
        key = (agent.election.term, agent.job.revision[0])
        if self.runner is not None and self._runner_key == key:
            if not self.runner.alive() and self.runner.result is not None:
                self._finished_key = key
            return
        if self._finished_key == key:
            return  # this run ended (its state write may not have reached us yet)
        self._stop_runner("new term or spec")
        from elasticyolo.engines.horovod.driver import DriverRunner

        assert agent.job.spec is not None
        self.runner = DriverRunner(client=_driver_client(agent), keys=agent.keys, election=agent.election,
                                   spec=agent.job.spec, addr=agent.cfg.addr,
                                   lease=lambda: agent.registration.lease_id, node_id=agent.cfg.node_id).start()
        self._runner_key = key

    def _stop_runner(self, reason: str) -> None:
        if self.runner is not None:
            self.runner.stop(reason)
            self.runner = None
            self._runner_key = None

    # ---- pre-warmed workers -------------------------------------------------------------
    def _manage_prewarm(self, agent: "Agent", want: bool) -> None:
        if not self.prewarm or self.launcher is None:
            return
        spec = agent.job.spec
        if not want or spec is None:
            if self.pool is not None:
                self._stop_pool()
                self._publish_ready(agent, None)
            return
        from elasticyolo.engines.horovod.prewarm import PrewarmPool

        slots = min(agent.cfg.slots, spec.slots)
        if self.pool is None or self.pool.spec_json != spec.to_json():
            self._stop_pool()
            self.pool = PrewarmPool(spec.to_json(), slots, self.launcher.work_dir, self.launcher.iface,
                                    node=agent.cfg.node_id, job=agent.cfg.job)
            self.launcher.spawner = self.pool
        if self.pool.gave_up:
            self.launcher.spawner = None
            self._publish_ready(agent, None)
            return
        running = self.launcher.running_slots()
        self.pool.fill(running)
        # Only slots whose worker is warm (or already training) are offered to Horovod.
        self._publish_ready(agent, len((self.pool.ready_slots() | running) & set(range(slots))))

    def _stop_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.launcher is not None:
            self.launcher.spawner = None

    def _publish_ready(self, agent: "Agent", ready: int | None) -> None:
        extra = agent.record.extra
        if extra.get("ready_slots") != ready:
            if ready is None:
                extra.pop("ready_slots", None)
            else:
                extra["ready_slots"] = ready
            agent._record_dirty = True  # written by the loop at the end of this iteration
            agent.wake()

    def _export_etcd_env(self, agent: "Agent") -> None:
        """Workers publish progress to etcd: they inherit the agent's connection settings through
        the environment (never the command line, never etcd)."""
        cfg = agent.cfg
        os.environ["ELASTICYOLO_ETCD"] = ",".join(cfg.etcd)
        for name in ("etcd_ca", "etcd_cert", "etcd_key", "etcd_user"):
            value = getattr(cfg, name)
            if value:
                os.environ[f"ELASTICYOLO_{name.upper()}"] = str(value)
        from elasticyolo.cluster.secrets import child_password_env  # the password as a file path only

        os.environ.update(child_password_env(cfg.etcd_password, cfg.etcd_password_file))


def _driver_client(agent: "Agent") -> Any:
    from elasticyolo.agent.daemon import make_client

    return make_client(agent.cfg)
