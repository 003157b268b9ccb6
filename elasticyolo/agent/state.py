"""The node state machine. `decide()` is the one place that chooses transitions; it is pure
(no etcd, no clock) so it can be tested step by step.

    JOINING --registered--> IDLE --job active--> TRAINING --job inactive--> IDLE
       |                     |                      |
       +---- drain requested / lease lost ----------+--> DRAINING --drained--> LEFT
    any non-terminal state --fatal--> FAILED

A lapsed lease (etcd expired the registration: a missed renewal under CPU load, a partition) is
not a departure: an IDLE or TRAINING node re-registers under a new lease and keeps its state and
its workers (`reregisters_in_place`). Whether the world goes on without the node is for the
engine's coordinator to decide (Horovod's driver withdraws a launch request, torch's rendezvous
forms a world without it), on evidence about the worker, never on the agent's own timer.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class NodeState(str, enum.Enum):
    JOINING = "JOINING"
    IDLE = "IDLE"
    TRAINING = "TRAINING"
    DRAINING = "DRAINING"
    LEFT = "LEFT"
    FAILED = "FAILED"

    @property
    def terminal(self) -> bool:
        return self in (NodeState.LEFT, NodeState.FAILED)


# Node states (as written in node records) whose slots a world may use: JOINING, DRAINING and
# LEFT nodes offer none.
SERVING_STATES = (NodeState.IDLE.value, NodeState.TRAINING.value)


@dataclass(frozen=True)
class Observation:
    """What the agent knows at one loop iteration."""

    registered: bool = False  # our node key exists under a live lease
    lease_lost: bool = False  # etcd says our lease is gone
    job_active: bool = False  # a valid spec is stored and the job is submitted/running
    drain_requested: bool = False  # SIGTERM/SIGINT, spot notice, or an operator
    drain_complete: bool = False  # plug-ins report workers stopped / world left
    fatal: str | None = None  # unrecoverable (e.g. node id taken for good)


@dataclass(frozen=True)
class Transition:
    old: NodeState
    new: NodeState
    reason: str


def decide(state: NodeState, obs: Observation) -> Transition | None:
    """The next state for `state` given `obs`, or None to stay."""

    def to(new: NodeState, reason: str) -> Transition:
        return Transition(state, new, reason)

    if state.terminal:
        return None
    if obs.fatal:
        return to(NodeState.FAILED, obs.fatal)
    if state is NodeState.DRAINING:
        return to(NodeState.LEFT, "drained") if obs.drain_complete else None
    if obs.drain_requested:
        return to(NodeState.DRAINING, "drain requested")
    if state is NodeState.JOINING:
        return to(NodeState.IDLE, "registered") if obs.registered else None
    if state is NodeState.IDLE and obs.job_active:
        return to(NodeState.TRAINING, "job active")
    if state is NodeState.TRAINING and not obs.job_active:
        return to(NodeState.IDLE, "job inactive")
    return None


def reregisters_in_place(state: NodeState, obs: Observation) -> bool:
    """Whether a member whose lease is gone registers again under a new lease, keeping its state
    (and so its workers) instead of starting over from JOINING."""
    return state in (NodeState.IDLE, NodeState.TRAINING) and (obs.lease_lost or not obs.registered)
