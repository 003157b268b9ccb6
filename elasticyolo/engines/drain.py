"""Leaving the world with as little lost work as the engine allows (agent side; no torch).

Shaped like torch's `dynamic_rendezvous.py`: what the executor has done so far (`DrainProgress`)
and what it just read (`DrainObservation`) go into one pure function, `decide`, which returns the
next `Act`; `DrainExecutor` observes, decides and applies, a few acts per agent loop iteration,
until `FINISH`. `tests/test_drain_decide.py` steps `decide` through every path without processes.

The plan (chosen once, by the engine's `plan_drain`, before the node is written DRAINING):

* **stop**: stop this node's workers (SIGTERM, SIGKILL after a grace); engines that restart
  their world on any change recover from their newest snapshot. With `survivors_report` (the
  torch engine, whose stopped worker leaves at its next commit while the others keep training)
  the drain then reads the survivors' `resume` record for the lost steps, as a leave does.
* **leave** (Horovod, a node the world can lose): the node record goes DRAINING, discovery drops
  the node, the world re-forms without it at the next commit (no rollback). The worker is not
  killed: it gets rank -1 and exits by itself. Only when the deadline comes first is it killed
  (`killed_at_deadline`). Then the survivors' `resume` record tells the lost steps.
* **handover** (Horovod, the node runs the driver or the job cannot shrink without it): write a
  `quiesce` request; at the next commit every rank snapshots (and, for the last node, rank 0
  checkpoints) and rank 0 acknowledges with the step (`quiesce_ack`). Then the coordinator is
  released (the driver stops and the leader resigns, when `hold`), the request is deleted and
  the workers are stopped; the next world restores exactly that snapshot. While it waits, the
  node record says `drain_mode: handover` so discovery keeps the node listed (a racing reset
  would otherwise remove it before the quiesce).
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Protocol

from elasticyolo.agent.plugin import NodeAPI
from elasticyolo.cluster.etcd import EtcdError
from elasticyolo.engines.base import DrainMode, DrainPlan
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger

# Stopping a worker takes up to spawn.KILL_GRACE_S (SIGTERM, then SIGKILL): start that much
# (plus a second) before the deadline; in a short drain window (a notice of a few seconds, as a
# compressed replay gives) at most a quarter of it, or the world never gets the chance to let the
# worker go at a commit (a full lead would kill a 1.5 s window's worker at once: a rollback every
# notice).
KILL_LEAD_S = 4.0
KILL_LEAD_FRACTION = 0.25


def kill_lead_s(window_s: float) -> float:
    """How long before the deadline a drain that started `window_s` before it stops waiting."""
    return min(KILL_LEAD_S, max(0.0, window_s) * KILL_LEAD_FRACTION)
# After our worker left, how long to wait for the survivors' resume record (lost-step count).
RESUME_WAIT_S = 5.0

log = get_logger("elasticyolo.drain")


class Act(str, enum.Enum):
    WRITE_REQUEST = "write_request"  # put the quiesce request
    ACCEPT_ACK = "accept_ack"  # the world quiesced at a commit: report it
    ACK_TIMEOUT = "ack_timeout"  # no ack before the deadline: go on without one
    RELEASE = "release"  # stop the coordinator / resign (hold), clear the request, record says leave
    STOP_WORKERS = "stop_workers"  # SIGTERM now, SIGKILL after the grace (repeated every iteration)
    KILL_AT_DEADLINE = "kill_at_deadline"  # leave: the world did not let the worker go in time
    NOTE_WORKER_GONE = "note_worker_gone"
    RECORD_RESUME = "record_resume"  # the survivors resumed: lost steps known
    RESUME_UNKNOWN = "resume_unknown"  # they did not report in time (or stopped)
    WAIT = "wait"
    FINISH = "finish"


# Acts after which the executor returns to the agent loop (the world needs time to react).
_YIELDS = {Act.STOP_WORKERS, Act.KILL_AT_DEADLINE, Act.WAIT, Act.FINISH}


@dataclass
class DrainProgress:
    """What the executor has done so far."""

    request_written: bool = False
    acked: bool = False
    released: bool = False
    killed: bool = False
    worker_gone_at: float | None = None  # monotonic
    resume_known: bool = False


@dataclass(frozen=True)
class DrainObservation:
    now: float  # monotonic
    deadline: float  # monotonic: the drain must be done by then
    workers_running: int
    ack: dict[str, Any] | None = None  # the quiesce_ack for our request
    resume: dict[str, Any] | None = None  # a resume record written after the drain started
    kill_lead_s: float = KILL_LEAD_S  # kill_lead_s(the drain's window)


def decide(plan: DrainPlan, done: DrainProgress, obs: DrainObservation) -> Act:
    """The next act of the drain. Pure: no I/O, no clock."""
    if plan.mode is DrainMode.STOP and (obs.workers_running or not plan.reads_resume):
        return Act.STOP_WORKERS if obs.workers_running else Act.FINISH
    if plan.mode is DrainMode.HANDOVER:
        if not done.request_written:
            return Act.WRITE_REQUEST
        if not done.acked:
            if obs.ack is not None:
                return Act.ACCEPT_ACK
            return Act.ACK_TIMEOUT if obs.now >= obs.deadline - obs.kill_lead_s else Act.WAIT
        if not done.released:
            return Act.RELEASE
    if obs.workers_running:
        if plan.mode is DrainMode.HANDOVER or done.killed:
            return Act.STOP_WORKERS
        return Act.KILL_AT_DEADLINE if obs.now >= obs.deadline - obs.kill_lead_s else Act.WAIT
    if done.worker_gone_at is None:
        return Act.NOTE_WORKER_GONE
    if plan.reads_resume and not done.resume_known:
        if obs.resume is not None:
            return Act.RECORD_RESUME
        if obs.now - done.worker_gone_at > RESUME_WAIT_S or obs.now >= obs.deadline:
            return Act.RESUME_UNKNOWN
        return Act.WAIT
    return Act.FINISH


class DrainEffects(Protocol):
    """What an engine's node plug-in does for the executor."""

    def running_workers(self) -> int: ...

    def stop_workers(self, reason: str) -> None:
        """Idempotent, called every iteration while workers run: SIGTERM, SIGKILL after a grace."""

    def release(self, reason: str) -> None:
        """Stop the engine's coordinator on this node (the driver), if any."""


class DrainExecutor:
    """Runs one drain plan of this node (created when the drain starts, stepped every iteration)."""

    MAX_ACTS_PER_STEP = 16

    def __init__(self, node: NodeAPI, plan: DrainPlan, effects: DrainEffects) -> None:
        self.node, self.plan, self.effects = node, plan, effects
        self.kill_lead_s = kill_lead_s(node.drain.deadline - time.monotonic())
        self.done = DrainProgress()
        self.request: dict[str, Any] | None = None
        self.acts: list[Act] = []  # history, for logs and tests

    # ---- start (before the DRAINING record is written) --------------------------------------
    def start(self) -> None:
        node, plan = self.node, self.plan
        if plan.quiesce is not None:
            q = plan.quiesce
            left = node.drain.deadline - time.monotonic() - self.kill_lead_s
            self.request = {"id": uuid.uuid4().hex[:12], "term": q.term, "checkpoint": q.checkpoint,
                            "hold": q.hold, "by": node.cfg.node_id, "at": time.time(), "timeout_s": max(1.0, left)}
        if plan.mode is not DrainMode.STOP:
            node.set_record_field("drain_mode", plan.mode.value)
        node.drain.report.update(mode=plan.mode.value, last_node=plan.last_node, step_at_notice=self._progress_step())
        log.info("drain planned", mode=plan.mode.value, last_node=plan.last_node,
                 hold=plan.holds_leadership, checkpoint=bool(plan.quiesce and plan.quiesce.checkpoint))
        if plan.mode is DrainMode.HANDOVER:
            self._write_request()  # before the DRAINING record: the world sees the request first

    # ---- one agent loop iteration -----------------------------------------------------------
    def step(self) -> bool:
        """True when the drain is done."""
        for _ in range(self.MAX_ACTS_PER_STEP):
            obs = self.observe()
            act = decide(self.plan, self.done, obs)
            self.acts.append(act)
            if act is Act.FINISH:
                self.effects.release("drained")
                return True
            if not self.apply(act, obs) or act in _YIELDS:
                return False
        return False

    def observe(self) -> DrainObservation:
        done, plan = self.done, self.plan
        ack = resume = None
        if plan.mode is DrainMode.HANDOVER and done.request_written and not done.acked:
            ack = self._read(self.node.keys.quiesce_ack)
            if ack is not None and (self.request is None or ack.get("id") != self.request["id"]):
                ack = None
        if plan.reads_resume and done.worker_gone_at is not None and not done.resume_known:
            resume = self._read(self.node.keys.resume)
            if resume is not None and float(resume.get("at", 0)) <= (self.node.drain.started_at or 0.0):
                resume = None
        return DrainObservation(now=time.monotonic(), deadline=self.node.drain.deadline,
                                workers_running=self.effects.running_workers(), ack=ack, resume=resume,
                                kill_lead_s=self.kill_lead_s)

    def apply(self, act: Act, obs: DrainObservation) -> bool:
        """Carry `act` out; False when it could not be (etcd): try again next iteration."""
        node, done, report = self.node, self.done, self.node.drain.report
        if act is Act.WRITE_REQUEST:
            return self._write_request()
        if act is Act.ACCEPT_ACK:
            ack = obs.ack or {}
            report.update(committed_step=ack.get("step"), checkpoint=ack.get("checkpoint"), lost_steps=0)
            log.info("world quiesced", step=ack.get("step"), checkpoint=ack.get("checkpoint"))
            done.acked = True
        elif act is Act.ACK_TIMEOUT:
            log.warning("no quiesce ack before the deadline; stopping anyway")
            report["quiesce_timeout"] = True
            done.acked = True
        elif act is Act.RELEASE:
            if self.request is not None and self.request.get("hold"):
                self.effects.release("handover after the drain snapshot")
                node.resign(f"draining: handed over at step {report.get('committed_step', '?')}")
            node.set_record_field("drain_mode", DrainMode.LEAVE.value)
            try:
                node.client.delete(node.keys.quiesce)
            except (UnavailableError, EtcdError):
                pass  # fenced by term on the worker side anyway
            done.released = True
        elif act is Act.KILL_AT_DEADLINE:
            log.warning("drain deadline near; killing the worker", seconds_left=round(node.drain.deadline - time.monotonic(), 1))
            report["killed_at_deadline"] = True
            done.killed = True
            self.effects.stop_workers("drain deadline")
        elif act is Act.STOP_WORKERS:
            self.effects.stop_workers("draining")
        elif act is Act.NOTE_WORKER_GONE:
            done.worker_gone_at = time.monotonic()
            report["worker_left_s"] = round(time.time() - (node.drain.started_at or 0), 2)
        elif act is Act.RECORD_RESUME:
            rec = obs.resume or {}
            report.update(lost_steps=rec.get("lost_steps"), committed_step=rec.get("step"),
                          world_after=rec.get("world"))
            done.resume_known = True
        elif act is Act.RESUME_UNKNOWN:
            report["lost_steps"] = None
            done.resume_known = True
        return True

    # ---- etcd -------------------------------------------------------------------------------
    def _write_request(self) -> bool:
        assert self.request is not None
        try:
            self.node.client.put(self.node.keys.quiesce, json.dumps(self.request))
        except (UnavailableError, EtcdError) as exc:
            log.warning("could not write the quiesce request; retrying", error=str(exc))
            return False
        self.done.request_written = True
        return True

    def _read(self, key: str) -> dict[str, Any] | None:
        try:
            return self.node.client.get_json(key)
        except (UnavailableError, EtcdError):
            return None

    def _progress_step(self) -> int | None:
        rec = self._read(self.node.keys.progress)
        return int(rec["step"]) if rec and rec.get("step") is not None else None

