"""Which nodes a world has lost, for every engine's coordinator (pure; agent side, no torch).

The leader's liveness server (`cluster/liveness.py`) judges each node's agent: DEAD (its
connection closed: the agent process is gone) or SUSPECT (no heartbeat within the timeout). A
silent agent alone is no evidence that its workers stopped: an agent starved of CPU, or frozen
while its workers train on, must not cost the world a member. So a SUSPECT node counts as lost
only while the world does not step (rank 0's reported step, tracked by `note_step`).
"""

from __future__ import annotations

from typing import Protocol

from elasticyolo.cluster.liveness import Verdict

# The world counts as stalled when rank 0's step has not advanced for this many times the recent
# interval between advances, and at least STALL_MIN_S (progress is reported at most twice a second).
STALL_PERIODS = 2.5
STALL_MIN_S = 1.0


class StepMemory(Protocol):
    step: int | None
    step_changed_at: float | None  # monotonic time the reported step last advanced
    step_period_s: float | None  # recent time between observed advances (an EMA)


def note_step(step: int | None, memory: StepMemory, now: float) -> None:
    """Track when rank 0's reported step last advanced, and how often it does (an EMA)."""
    if step is None:
        return
    if memory.step is None or step < memory.step:  # first sight, or a new submission/rollback
        memory.step, memory.step_changed_at = step, now
        return
    if step > memory.step:
        if memory.step_changed_at is not None:
            gap = now - memory.step_changed_at
            memory.step_period_s = gap if memory.step_period_s is None else 0.7 * memory.step_period_s + 0.3 * gap
        memory.step, memory.step_changed_at = step, now


def world_stalled(step_changed_at: float | None, step_period_s: float | None, now: float) -> bool:
    """Whether the world has stopped stepping (no step seen yet counts as stalled: nothing shows
    that a suspect node's worker takes part)."""
    if step_changed_at is None:
        return True
    window = max(STALL_MIN_S, STALL_PERIODS * (step_period_s or 0.0))
    return now - step_changed_at > window


def lost_nodes(verdicts: dict[str, Verdict], stalled: bool) -> set[str]:
    """The nodes a coordinator treats as lost: every DEAD one (its agent and workers are gone),
    and the SUSPECT ones only while the world does not step (a silent agent alone is no evidence)."""
    return {n for n, v in verdicts.items() if v is Verdict.DEAD or (v is Verdict.SUSPECT and stalled)}


def etcd_answers(view_age_s: float, heartbeat_timeout_s: float) -> bool:
    """Whether the leader's last etcd read is recent enough to trust its liveness verdicts. A
    suspect went silent `heartbeat_timeout_s` ago (less one heartbeat interval at most); had the
    leader been cut off then, its reads (every 0.2 s) would have stopped as long ago. Holds for
    heartbeat intervals below half the timeout (the default: 0.25 s of 2 s)."""
    return view_age_s < heartbeat_timeout_s / 2
