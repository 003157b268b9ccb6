"""The torch engine on one node (agent side; no torch): while the node is TRAINING the job, keep
one launcher process running (`launcher.py`: this node's workers, warm, one per slot); stop it on
cancel, drain and agent stop. On the leader, also run the world coordinator (`coordinator.py`),
which publishes every new world the workers re-form into.

Why a child process rather than threads of the agent: the agent stays torch-free (fast start,
small memory; the launcher forks the workers' zygote after importing torch once), and a crash of
the launcher cannot take the node daemon (lease, spot notices) down with it.
Kill chain: the launcher is a `SupervisedProcess` (forked and waited on by its own thread) that
dies with the agent (`worker_runtime/lifeline.py`), and its workers die with it the same way, so
SIGKILL of the agent kills launcher and workers. A stop that does not finish in `stop_grace_s`
(in a drain: by the drain's kill lead before its deadline) gets SIGKILL on the launcher's process
group (workers follow through PDEATHSIG).

The launcher restarts a failed worker and never ends the job: the leader fails it when every
node's workers crash in a loop (`engines/crash_loop.py`, applied by `crash_loop_watch.py`), with
the workers' reason. The job ends (done) when the node whose worker finished it as rank 0 sees
its launcher exit 0: after the final checkpoint and the run folder are out. Nodes that finished
as other ranks wait for that, and end the job themselves after `END_FALLBACK_S` if rank 0's node
is gone.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticyolo.agent.plugin import NodeAPI
from elasticyolo.agent.staging import data_ready
from elasticyolo.agent.state import NodeState
from elasticyolo.cluster.job_state import JobEvent
from elasticyolo.cluster.jobs import set_job_state
from elasticyolo.cluster.settings import EtcdSettings
from elasticyolo.engines.crash_loop_watch import CrashLoopWatch
from elasticyolo.engines.node import EngineNode
from elasticyolo.engines.torch.coordinator import WorldCoordinator, member_records
from elasticyolo.engines.base import DrainSituation
from elasticyolo.engines.torch.launcher import EXIT_FINISHED_ELSEWHERE, LaunchSettings
from elasticyolo.log import get_logger
from elasticyolo.worker_runtime.spawn import SupervisedProcess
from elasticyolo.worker_runtime.worker_env import WorkerEnv, node_work_dir
from elasticyolo.worker_runtime.worker_errors import WorkerErrors

if TYPE_CHECKING:
    from elasticyolo.agent.job import JobView
    from elasticyolo.agent.state import Transition
    from elasticyolo.engines.base import Engine

log = get_logger("elasticyolo.torch.agent")

# How long after finishing as other ranks a node waits for rank 0's node to end the job (its final
# checkpoint and run folder uploads) before it ends the job itself.
END_FALLBACK_S = 180.0


class LauncherProcess(SupervisedProcess):
    """The node's launcher for one submission (`generation`)."""

    def __init__(self, generation: int, cmd: list[str], env: dict[str, str], worker_env: WorkerEnv,
                 on_exit: Any) -> None:
        self.generation = generation
        # Its output (its own log, torch's, its workers') through the agent's log stream: the journal
        # and the shipped logs (agent/log_shipping.py) get it.
        super().__init__(cmd, env, worker_env, name=f"torch-launcher-{generation}", on_exit=on_exit,
                         cwd=worker_env.worker_dir, forward=True)


class TorchNode(EngineNode):
    def __init__(self, engine: "Engine", agent: NodeAPI, *, stop_grace_s: float = 20.0,
                 retry_s: tuple[float, float] = (2.0, 60.0)) -> None:
        super().__init__(engine, agent)
        self.cfg = agent.cfg
        self.stop_grace_s = stop_grace_s
        self.retry_s = retry_s
        self.coordinator: WorldCoordinator | None = None
        self._proc: LauncherProcess | None = None
        self._stopping: list[LauncherProcess] = []
        self._finished: set[int] = set()
        # (generation, when): this node finished the job as other ranks than 0; rank 0's node ends
        # it, and this node does if that has not happened by then (rank 0's node gone meanwhile).
        self._end_fallback: tuple[int, float] | None = None
        self._failures = 0
        self._retry_at = 0.0
        # torch restarts failing workers forever: the job fails when they crash in a loop everywhere.
        self.crash_loop = CrashLoopWatch(self.engine.name)
        self._errors: WorkerErrors | None = None
        self._work: tuple[Path, int] | None = None  # (directory, generation) of the newest launcher

    @property
    def errors(self) -> WorkerErrors:
        """The workers torch starts (and their warm pool) fail in the launcher's directory; their
        errors are published from there (made on first use: the agent's etcd client)."""
        if self._errors is None:
            agent = self.agent
            self._errors = WorkerErrors(agent.client, agent.keys, agent.cfg.node_id, log,
                                        observe=self.crash_loop.observe)
        return self._errors

    # ---- plug-in callbacks ------------------------------------------------------------------
    def on_job_change(self, agent: NodeAPI, job: "JobView") -> None:
        self._reconcile(agent)

    def on_state_change(self, agent: NodeAPI, transition: "Transition") -> None:
        self._reconcile(agent)

    def on_tick(self, agent: NodeAPI) -> None:
        if agent.state is not NodeState.DRAINING:
            self._reconcile(agent)
        self.crash_loop.check(agent)

    def release(self, reason: str) -> None:
        self._stop_coordinator(reason)

    def on_stop(self, agent: NodeAPI) -> None:
        self._stop_coordinator("agent stopping")
        self._stop_current("agent stopping")
        deadline = time.monotonic() + self.stop_grace_s
        for lp in list(self._stopping):
            if not lp.wait(max(0.0, deadline - time.monotonic())):
                log.warning("launcher ignored SIGTERM; killing its process group", pid=lp.pid)
                lp.kill()
                lp.wait(5)
        self._stopping.clear()

    # ---- drain effects (engines/drain.py) -----------------------------------------------------
    def drain_situation(self, agent: NodeAPI) -> DrainSituation:
        """The other nodes' workers that can train on (their member records, not leaving)."""
        spec, running = agent.job.spec, self.running_workers()
        if spec is None or self._proc is None or running == 0:
            return DrainSituation(has_work=running > 0)
        records = member_records(agent.client, agent.keys.torch_members(self._proc.generation))
        others = sum(1 for r in records.values() if r.node != self.cfg.node_id and not r.leaving)
        return DrainSituation(has_work=True, other_slots=others, needed_slots=spec.min_nodes * spec.slots)

    def running_workers(self) -> int:
        self._reap()
        return int(self._proc is not None) + len(self._stopping)

    def stop_workers(self, reason: str) -> None:
        self._stop_current(reason)
        self._reap(kill_now=self._drain_deadline_near())

    def _drain_deadline_near(self) -> bool:
        """A drain's launcher gets its SIGKILL before the node's deadline, not `stop_grace_s` after
        its SIGTERM (the drain window may be shorter): the node then leaves in time and its record
        going tells the other nodes' rendezvous at once."""
        drain = self.drain
        return drain is not None and time.monotonic() >= self.agent.drain.deadline - drain.kill_lead_s

    # ---- reconciliation (agent loop thread) ------------------------------------------------
    def wanted(self, agent: NodeAPI) -> int | None:
        """The generation this node should be training, or None."""
        job = agent.job
        if agent.state is not NodeState.TRAINING or not job.active or job.spec is None:
            return None
        if not data_ready(agent.record.extra):  # its s3:// dataset is still being staged
            return None
        return job.generation

    def _coordinate(self, agent: NodeAPI) -> None:
        """The leader runs the coordinator of the active submission; no other node does."""
        job = agent.job
        gen = job.generation if agent.is_leader and job.active and job.spec is not None else None
        current = self.coordinator
        if current is not None and current.generation != gen:
            self._stop_coordinator("leadership or submission changed")
        if gen is not None and self.coordinator is None:
            spec = job.spec
            assert spec is not None
            self.coordinator = WorldCoordinator(agent, gen, min_nodes=spec.min_nodes,
                                                max_nodes=spec.max_nodes or (1 << 20),
                                                record_grace_s=max(agent.election.reclaim_grace_s, 2.0 * self.cfg.ttl))
            self.coordinator.start()

    def _stop_coordinator(self, reason: str) -> None:
        c, self.coordinator = self.coordinator, None
        if c is not None:
            log.info("stopping the torch world coordinator", reason=reason)
            c.stop()

    def _reconcile(self, agent: NodeAPI) -> None:
        self._coordinate(agent)
        self._reap()
        if self._work is not None:
            self.errors.publish_pending(*self._work)
            self.crash_loop.publish(agent)
        gen = self.wanted(agent)
        if self._end_fallback is not None and time.monotonic() >= self._end_fallback[1]:
            log.warning("rank 0's node did not end the finished job; ending it", generation=self._end_fallback[0])
            self._mark_done(agent, self._end_fallback[0])
            self._end_fallback = None
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

    def _finished_run(self, agent: NodeAPI, lp: LauncherProcess) -> None:
        rc = lp.returncode
        if rc == 0:
            log.info("torch job finished on this node", generation=lp.generation, rc=rc)
            self._finished.add(lp.generation)
            self._failures = 0
            self._mark_done(agent, lp.generation)
            return
        if rc == EXIT_FINISHED_ELSEWHERE:
            log.info("torch job finished on this node; rank 0's node ends it", generation=lp.generation)
            self._finished.add(lp.generation)
            self._failures = 0
            self._end_fallback = (lp.generation, time.monotonic() + END_FALLBACK_S)
            return
        self._failures += 1
        delay = min(self.retry_s[0] * 2 ** (self._failures - 1), self.retry_s[1])
        self._retry_at = time.monotonic() + delay
        log.warning("torch launcher exited; restarting", generation=lp.generation, rc=rc, retry_in_s=delay)

    def _mark_done(self, agent: NodeAPI, generation: int) -> None:
        try:
            set_job_state(agent.client, agent.keys, JobEvent.FINISH, generation=generation,
                          by=f"agent {self.cfg.node_id} (torch)")
        except Exception as exc:  # noqa: BLE001 - another node may write it; never fatal
            log.warning("could not mark the job done", error=str(exc))

    def _reap(self, kill_now: bool = False) -> None:
        now = time.monotonic()
        for lp in list(self._stopping):
            if not lp.running:
                self._stopping.remove(lp)
            elif kill_now or (lp.stop_requested_at is not None and now - lp.stop_requested_at > self.stop_grace_s):
                log.warning("launcher still running after SIGTERM; killing its process group", pid=lp.pid,
                            drain_deadline=kill_now)
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
    def _start(self, agent: NodeAPI, generation: int) -> None:
        spec = agent.job.spec
        assert spec is not None
        cfg = self.cfg
        work_dir = node_work_dir(cfg.work_dir, cfg.job, cfg.node_id, generation)
        self._work = (work_dir, generation)
        settings = LaunchSettings(slots=cfg.slots)
        env = WorkerEnv(etcd=EtcdSettings.from_config(cfg), job=cfg.job, node_id=cfg.node_id,
                        spec_json=spec.to_json(), generation=generation, worker_dir=str(work_dir),
                        engine_config=settings.to_json())
        cmd = [sys.executable, "-m", "elasticyolo.engines.torch.launcher"]
        try:
            self._proc = LauncherProcess(generation, cmd, dict(os.environ), env, on_exit=agent.wake)
        except OSError as exc:
            self._failures += 1
            self._retry_at = time.monotonic() + self.retry_s[1]
            log.error("could not start the torch launcher", error=str(exc))
            return
        log.info("torch launcher started", pid=self._proc.pid, generation=generation, slots=cfg.slots)
