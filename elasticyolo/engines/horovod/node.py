"""The Horovod engine on one node (agent side; no torch): every agent runs a worker `Launcher`
(and a `PrewarmPool` of warm workers); the leader also runs a `DriverRunner` while the job is
active. Created by `engines/dispatch.py` for `engine=horovod` jobs.

Everything here runs on the agent loop thread and only starts/stops threads and processes, so
it never blocks the loop for long. etcd hiccups are logged and retried on the next tick.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from elasticyolo.agent.plugin import LEASE_LAPSED, NodeAPI
from elasticyolo.agent.state import NodeState
from elasticyolo.cluster.etcd import EtcdError
from elasticyolo.engines.base import DrainMode, DrainSituation
from elasticyolo.engines.horovod.drain import other_serving_slots
from elasticyolo.engines.node import EngineNode
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger
from elasticyolo.worker_runtime.prewarm import prewarm_enabled
from elasticyolo.worker_runtime.worker_env import node_work_dir

if TYPE_CHECKING:
    from elasticyolo.engines.base import Engine
    from elasticyolo.engines.horovod.driver import DriverRunner
    from elasticyolo.engines.horovod.launcher import Launcher
    from elasticyolo.worker_runtime.prewarm import PrewarmPool


class HorovodNode(EngineNode):
    def __init__(self, engine: "Engine", agent: NodeAPI, prewarm: bool | None = None) -> None:
        super().__init__(engine, agent)
        self.launcher: "Launcher | None" = None
        self.runner: "DriverRunner | None" = None
        self.pool: "PrewarmPool | None" = None
        self._runner_key: tuple[int, int] | None = None  # (term, spec revision) the runner serves
        self._finished_key: tuple[int, int] | None = None
        self._orphaned_at: float | None = None  # monotonic: the driver's leadership lapsed with the lease
        self._generation: int | None = None
        self._pruned = True  # older submissions' directories deleted (once their workers are gone)
        self.prewarm = prewarm_enabled() if prewarm is None else prewarm
        self.log = get_logger("elasticyolo.horovod", node=agent.cfg.node_id, job=agent.cfg.job)

    # ---- lifecycle ----------------------------------------------------------------------
    def on_start(self, agent: NodeAPI) -> None:
        from elasticyolo.cluster.settings import EtcdSettings
        from elasticyolo.engines.horovod.launcher import Launcher
        from elasticyolo.worker_runtime.worker_env import WorkerEnv

        cfg = agent.cfg
        # Workers report progress to etcd: they get the agent's connection settings through their
        # environment (never the command line, never etcd).
        env = WorkerEnv(etcd=EtcdSettings.from_config(cfg), job=cfg.job, node_id=cfg.node_id)
        self.launcher = Launcher(agent.new_client(), agent.keys, cfg.node_id, cfg.addr, lease=agent.lease_id,
                                 wake=agent.wake, worker_env=env)

    def on_tick(self, agent: NodeAPI) -> None:
        job = agent.job
        active = job.active and job.spec is not None
        serving = agent.state in (NodeState.IDLE, NodeState.TRAINING)
        draining = agent.state is NodeState.DRAINING and self.drain_mode not in (None, DrainMode.STOP)
        if active and self.launcher is not None:
            cfg = agent.cfg
            if job.generation != self._generation:
                self._generation, self._pruned = job.generation, False
                self.launcher.work_dir = node_work_dir(cfg.work_dir, cfg.job, cfg.node_id, job.generation, prune=False)
                self.launcher.worker_env = replace(self.launcher.worker_env, generation=job.generation)
            if not self._pruned and self.launcher.running() == 0:
                node_work_dir(cfg.work_dir, cfg.job, cfg.node_id, job.generation, prune=True)
                self._pruned = True
        if self.launcher is not None:  # warm workers' failures (plain workers' publish as they exit)
            self.launcher.errors.publish_pending(self.launcher.work_dir, self._generation)
        try:
            self._manage_prewarm(agent, active and serving)
            if self.launcher is not None:
                # Draining: the worker keeps running until the world lets it go (engines/drain.py);
                # only a withdrawn request (the driver stopped) stops it here.
                self.launcher.reconcile(active and (serving or draining))
        except (UnavailableError, EtcdError) as exc:
            self.log.warning("launcher could not read etcd; will retry", error=str(exc))
        if not draining:
            self._manage_driver(agent, active and serving and agent.is_leader)

    def on_lose_leadership(self, agent: NodeAPI, reason: str) -> None:
        if reason == LEASE_LAPSED and self.runner is not None and self.runner.alive():
            # The lead may come back with the re-registered lease (the followers wait for that,
            # cluster/election.py): the driver keeps the running world meanwhile. Its writes are
            # fenced, so it changes nothing while another node leads.
            self._orphaned_at = time.monotonic()
            self.log.info("leadership lapsed with the lease; keeping the driver to take the lead back",
                          grace_s=agent.election.reclaim_grace_s)
            return
        self.release(f"lost leadership: {reason}")

    def on_drain(self, agent: NodeAPI, deadline: float) -> bool:
        self._stop_pool()
        return super().on_drain(agent, deadline)

    def on_stop(self, agent: NodeAPI) -> None:
        self.release("agent stopping")
        self._stop_pool()
        if self.launcher is not None:
            self.launcher.kill_all_now()

    # ---- drain effects (engines/drain.py) -------------------------------------------------
    def drain_situation(self, agent: NodeAPI) -> DrainSituation:
        spec = agent.job.spec
        runs_driver = self.runner is not None and self.runner.alive()
        has_worker = self.running_workers() > 0
        if spec is None or not (runs_driver or has_worker):
            return DrainSituation(has_work=False)
        return DrainSituation(
            has_work=True, runs_coordinator=runs_driver,
            coordinator_term=self.runner.term if runs_driver and self.runner is not None else None,
            other_slots=other_serving_slots(agent.client, agent.keys, agent.cfg.node_id, spec.slots),
            needed_slots=spec.min_nodes * spec.slots)

    def running_workers(self) -> int:
        return self.launcher.running() if self.launcher is not None else 0

    def stop_workers(self, reason: str) -> None:
        self.release(reason)
        if self.launcher is not None:
            self.launcher.stop_all(reason)

    def release(self, reason: str) -> None:
        """Stop the driver this node runs for the job (leader only), if any."""
        if self.runner is not None:
            self.runner.stop(reason)
            self.runner = None
            self._runner_key = None

    # ---- driver (leader only) -----------------------------------------------------------
    def _manage_driver(self, agent: NodeAPI, want: bool) -> None:
        key = (agent.election.term, agent.job.generation)
        if self._orphaned_at is not None and self.runner is not None:
            if want and self.runner.alive() and self._runner_key is not None and self._runner_key[1] == key[1]:
                self.runner.adopt(agent.election.term)  # the lead is back: same driver, same world
                self._runner_key, self._orphaned_at = key, None
                return
            leader = agent.election.leader
            other_leads = leader is not None and leader.node_id != agent.cfg.node_id and not agent.is_leader
            if not want and not other_leads and time.monotonic() - self._orphaned_at < agent.election.reclaim_grace_s \
                    and agent.job.active:
                return  # still waiting to take the lead back
        self._orphaned_at = None
        if not want:
            if self.runner is not None:
                self.release("job inactive or not leader")
            return
        if self.runner is not None and self._runner_key == key:
            if not self.runner.alive() and self.runner.result is not None:
                self._finished_key = key
            return
        if self._finished_key == key:
            return  # this run ended (its state write may not have reached us yet)
        self.release("new term or spec")
        from elasticyolo.engines.horovod.driver import DriverRunner

        assert agent.job.spec is not None
        self.runner = DriverRunner(client=agent.new_client(), keys=agent.keys, election=agent.election,
                                   spec=agent.job.spec, addr=agent.cfg.addr, lease=agent.lease_id,
                                   node_id=agent.cfg.node_id, liveness=getattr(agent, "liveness", None)).start()
        self._runner_key = key

    # ---- pre-warmed workers -------------------------------------------------------------
    def _manage_prewarm(self, agent: NodeAPI, want: bool) -> None:
        if not self.prewarm or self.launcher is None:
            return
        spec = agent.job.spec
        if not want or spec is None:
            if self.pool is not None:
                self._stop_pool()
                agent.set_record_field("ready_slots", None)
            return
        from elasticyolo.worker_runtime.prewarm import PrewarmPool

        slots = min(agent.cfg.slots, spec.slots)
        work_dir: Path = self.launcher.work_dir
        if self.pool is None or self.pool.spec_json != spec.to_json() or self.pool.work_dir != work_dir:
            self._stop_pool()
            self.pool = PrewarmPool(spec.to_json(), slots, work_dir, self.launcher.iface_env(),
                                    worker_modules=self.engine.worker_modules, node=agent.cfg.node_id,
                                    job=agent.cfg.job)
            self.launcher.spawner = self.pool
        if self.pool.gave_up:
            self.launcher.spawner = None
            agent.set_record_field("ready_slots", None)
            return
        running = self.launcher.running_slots()
        self.pool.fill(running)
        # Only slots whose worker is warm (or already training) are offered to Horovod.
        agent.set_record_field("ready_slots", len((self.pool.ready_slots() | running) & set(range(slots))))

    def _stop_pool(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        if self.launcher is not None:
            self.launcher.spawner = None
