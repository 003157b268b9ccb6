"""Draining a node out of a Horovod world with zero lost steps (agent side; no torch).

Two ways out, chosen when the drain starts (`plan`):

* **leave** (a node that neither runs the driver nor is needed for `min_nodes`): its record goes
  DRAINING, discovery stops listing it, the driver sees a *removed host* and notifies rank 0; at
  the next commit every rank raises HostsUpdatedInterrupt (the state was saved just before), the
  survivors re-form without the node and carry on from that commit (no rollback). The draining
  worker is *not* killed: it reaches the new rendezvous, gets rank -1 from the driver (Horovod's
  "removed from elastic job") and exits by itself; the driver ignores the exit of a host that has
  no rank any more, so nothing is counted as a failure or blacklisted. Rank 0 on the node is not
  special: every rank holds the committed state and the next rank 0 broadcasts it.
* **handover** (the node runs the driver, or the world cannot shrink without it): the agent
  writes a *quiesce* request; rank 0 sees it, and at the next commit all ranks agree on it
  through the broadcast Horovod already does there, write a node-local snapshot of that commit
  on every node (and, for the last node, a store checkpoint), and rank 0 acknowledges with the
  step. Then the leader stops its driver and resigns; the next leader's driver starts a world
  that restores exactly that snapshot (`ELASTICYOLO_RESTORE`). While quiescing, the node's
  record says `drain_mode: handover` so discovery keeps listing it (a racing hosts-updated reset
  would otherwise beat the request).

Keys (under the job prefix): `quiesce` {"id", "term", "checkpoint", "hold", "timeout_s", "by"},
`quiesce_ack` {"id", "step", "epoch", "checkpoint", "at"}, and `resume` {"step", "world",
"lost_steps", "term", "at"} written by rank 0 whenever a world (re)starts training.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from elasticyolo.cluster.etcd import EtcdError
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.engines.horovod.discovery import SERVING_STATES
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger

if TYPE_CHECKING:
    from elasticyolo.agent.daemon import Agent
    from elasticyolo.engines.horovod.node import HorovodEngineHooks

# A draining worker gets this long between SIGTERM and SIGKILL (launcher.KILL_GRACE_S) before the
# deadline, so the kill starts this much earlier.
KILL_LEAD_S = 4.0
# After our worker left, how long to wait for the survivors' resume record (lost-step count).
RESUME_WAIT_S = 5.0

log = get_logger("elasticyolo.horovod.drain")


def quiesce_key(keys: JobKeys) -> str:
    return keys.prefix + "quiesce"


def quiesce_ack_key(keys: JobKeys) -> str:
    return keys.prefix + "quiesce_ack"


def resume_key(keys: JobKeys) -> str:
    return keys.prefix + "resume"


def read_json(client: Any, key: str) -> dict[str, Any] | None:
    got = client.get(key)
    if got is None:
        return None
    try:
        value = json.loads(got[0])
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class HorovodDrain:
    """One drain of this node (created by `HorovodEngineHooks.before_drain`, stepped by `on_drain`)."""

    def __init__(self, agent: "Agent", hooks: "HorovodEngineHooks") -> None:
        self.agent, self.hooks = agent, hooks
        self.keys = agent.keys
        self.mode = "idle"  # idle | leave | handover
        self.phase = "start"
        self.request: dict[str, Any] | None = None
        self.ack: dict[str, Any] | None = None
        self.worker_gone_at: float | None = None
        self.killed = False

    # ---- planning (before the DRAINING record is written) ------------------------------------
    def plan(self) -> None:
        agent, hooks = self.agent, self.hooks
        spec = agent.job.spec
        runs_driver = hooks.runner is not None and hooks.runner.alive()
        has_worker = hooks.launcher is not None and hooks.launcher.running() > 0
        if spec is None or spec.engine != "horovod" or not (runs_driver or has_worker):
            self.mode = "idle"
            return
        others = self._other_slots(spec.slots)
        last = others < spec.min_nodes * spec.slots
        if runs_driver or last:
            self.mode = "handover"
            self.request = {"id": uuid.uuid4().hex[:12], "term": hooks.runner.term if runs_driver else None,
                            "checkpoint": last, "hold": runs_driver, "by": agent.cfg.node_id, "at": time.time(),
                            "timeout_s": max(1.0, agent.drain_deadline - time.monotonic() - KILL_LEAD_S)}
            agent.record.extra["drain_mode"] = "handover"
            self._write_request()
        else:
            self.mode = "leave"
            agent.record.extra["drain_mode"] = "leave"
        agent.drain_report.update(mode=self.mode, last_node=last, step_at_notice=self._progress_step())
        log.info("drain planned", mode=self.mode, runs_driver=runs_driver, last_node=last, other_slots=others)

    def _other_slots(self, max_slots: int) -> int:
        from elasticyolo.cluster.registry import read_nodes

        total = 0
        for rec, _ in read_nodes(self.agent.client, self.keys):
            if rec.node_id != self.agent.cfg.node_id and rec.state in SERVING_STATES:
                ready = rec.extra.get("ready_slots")
                total += min(int(rec.slots if ready is None else ready), max_slots)
        return total

    def _progress_step(self) -> int | None:
        try:
            rec = read_json(self.agent.client, self.keys.progress)
        except (UnavailableError, EtcdError):
            return None
        return int(rec["step"]) if rec and rec.get("step") is not None else None

    def _write_request(self) -> None:
        assert self.request is not None
        try:
            self.agent.client.put(quiesce_key(self.keys), json.dumps(self.request))
        except (UnavailableError, EtcdError) as exc:
            log.warning("could not write the quiesce request; retrying", error=str(exc))
            self.phase = "retry-request"
            return
        self.phase = "await-ack"

    # ---- one step per agent loop iteration ----------------------------------------------------
    def step(self, deadline: float) -> bool:
        now = time.monotonic()
        launcher = self.hooks.launcher
        if self.mode == "idle":
            return launcher is None or launcher.stop_all("draining")
        if self.mode == "handover" and self.phase in ("retry-request", "await-ack"):
            if self.phase == "retry-request":
                self._write_request()
            if not self._await_ack(now, deadline):
                return False
            self._after_ack()
        # leave: the worker exits by itself once the world re-formed without it; kill it only
        # when the deadline comes first. handover: the driver is stopped, workers get SIGTERM.
        running = launcher.running() if launcher is not None else 0
        if running and (self.mode == "handover" or now >= deadline - KILL_LEAD_S):
            if not self.killed and self.mode == "leave":
                log.warning("drain deadline near; killing the worker", seconds_left=round(deadline - now, 1))
                self.agent.drain_report["killed_at_deadline"] = True
            self.killed = True
            launcher.stop_all("drain")  # type: ignore[union-attr]
        if running:
            return False
        if self.worker_gone_at is None:
            self.worker_gone_at = now
            self.agent.drain_report["worker_left_s"] = round(time.time() - (self.agent.drain_started_at or 0), 2)
        return self._lost_steps_known(now, deadline)

    def _await_ack(self, now: float, deadline: float) -> bool:
        assert self.request is not None
        try:
            ack = read_json(self.agent.client, quiesce_ack_key(self.keys))
        except (UnavailableError, EtcdError):
            ack = None
        if ack is not None and ack.get("id") == self.request["id"]:
            self.ack = ack
            self.agent.drain_report.update(committed_step=ack.get("step"), checkpoint=ack.get("checkpoint"),
                                           lost_steps=0)
            log.info("world quiesced", step=ack.get("step"), checkpoint=ack.get("checkpoint"))
            return True
        if now >= deadline - KILL_LEAD_S:
            log.warning("no quiesce ack before the deadline; stopping anyway")
            self.agent.drain_report["quiesce_timeout"] = True
            return True
        return False

    def _after_ack(self) -> None:
        self.phase = "stopping"
        agent = self.agent
        if self.request and self.request.get("hold"):
            self.hooks._stop_runner("handover after drain snapshot")
            agent.resign(f"draining: handed over at step {self.ack.get('step') if self.ack else '?'}")
        agent.record.extra["drain_mode"] = "leave"
        agent._record_dirty = True
        try:
            agent.client.delete(quiesce_key(self.keys))
        except (UnavailableError, EtcdError):
            pass  # fenced by term on the worker side anyway

    def _lost_steps_known(self, now: float, deadline: float) -> bool:
        """Leave mode: wait briefly for the survivors' resume record to report lost steps."""
        report = self.agent.drain_report
        if self.mode != "leave" or "lost_steps" in report:
            return True
        try:
            rec = read_json(self.agent.client, resume_key(self.keys))
        except (UnavailableError, EtcdError):
            rec = None
        started = self.agent.drain_started_at or 0.0
        if rec is not None and float(rec.get("at", 0)) > started:
            report.update(lost_steps=rec.get("lost_steps"), committed_step=rec.get("step"),
                          world_after=rec.get("world"))
            return True
        assert self.worker_gone_at is not None
        if now - self.worker_gone_at > RESUME_WAIT_S or now >= deadline:
            report["lost_steps"] = None  # the world did not report in time (or stopped)
            return True
        return False
