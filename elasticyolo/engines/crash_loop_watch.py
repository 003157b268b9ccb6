"""Applies the crash-loop rule (`crash_loop.py`) from an agent (no torch here).

Every node (`publish`): counts its workers' error records (`worker_errors.WorkerErrors`'s
`observe`) by round and keeps the counts in its node record (`RECORD_FIELD`), leased with the node:
a node that is gone no longer counts.

The leader (`check`, at most every `check_s`): reads the node records and the job's `progress`,
judges, and fails the job with the workers' reason (`worker_errors.failure_reason`) in one txn fenced
by the submission, the job's state and its own term: a deposed leader writes nothing.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

from elasticyolo.agent.state import NodeState
from elasticyolo.cluster.etcd import EtcdError
from elasticyolo.cluster.jobs import set_job_state
from elasticyolo.cluster.job_state import JobEvent
from elasticyolo.cluster.registry import read_nodes
from elasticyolo.engines.crash_loop import RECORD_FIELD, CrashLoopState, CrashTally, NodeCrashes, judge
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger
from elasticyolo.worker_runtime.worker_errors import failure_reason

if TYPE_CHECKING:
    from elasticyolo.agent.plugin import NodeAPI

log = get_logger("elasticyolo.crash_loop")

CHECK_S = 1.0


class CrashLoopWatch:
    def __init__(self, engine: str, check_s: float = CHECK_S) -> None:
        self.engine = engine
        self.check_s = check_s
        self.tally = CrashTally()
        self.state = CrashLoopState()
        self._changed = False
        self._next_check = 0.0

    # ---- every node ---------------------------------------------------------------------------
    def observe(self, rec: dict[str, Any]) -> None:
        """`WorkerErrors`'s hook: one error record read on this node."""
        self._changed |= self.tally.add(rec)

    def publish(self, agent: "NodeAPI") -> None:
        if self._changed:
            self._changed = False
            agent.set_record_field(RECORD_FIELD, self.tally.as_record())

    # ---- the leader ---------------------------------------------------------------------------
    def check(self, agent: "NodeAPI") -> bool:
        """Judge the job (the leader only, while it is active); True if this call failed it."""
        job = agent.job
        now = time.monotonic()
        if not agent.is_leader or not job.active or now < self._next_check:
            return False
        self._next_check = now + self.check_s
        generation = job.generation
        try:
            serving = {rec.node_id: NodeCrashes.from_record(rec.extra.get(RECORD_FIELD), generation)
                       for rec, _lease in read_nodes(agent.client, agent.keys)
                       if rec.state == NodeState.TRAINING.value}
            verdict = judge(self.state, generation, serving, progress_step(agent))
            if not verdict.fail:
                return False
            reason = failure_reason(agent.client, agent.keys, verdict.reason or "workers crashed")
            failed = set_job_state(agent.client, agent.keys, JobEvent.FAIL, generation=generation,
                                   by=f"leader {agent.cfg.node_id} ({self.engine})", reason=reason,
                                   fence=[agent.election.fenced_txn_compare()])
        except (UnavailableError, EtcdError) as exc:
            log.warning("could not judge the job's worker crashes; will retry", error=str(exc))
            return False
        if failed:
            log.error("job failed: its workers crash in a loop", streaks=verdict.streaks, reason=reason)
        return failed


def progress_step(agent: "NodeAPI") -> int | None:
    got = agent.client.get(agent.keys.progress)
    if got is None:
        return None
    try:
        step = json.loads(got[0]).get("step")
    except (ValueError, AttributeError):
        return None
    return int(step) if isinstance(step, (int, float)) else None
