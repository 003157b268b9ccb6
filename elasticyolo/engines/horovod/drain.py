"""How a node leaves a Horovod world (the engine's drain planner; `engines/drain.py` runs the plan).

* **leave** when the node neither runs the driver nor is needed for `min_nodes`: Horovod's own
  removed-host path re-forms the world at the next commit without rolling back (the survivors
  saved the state just before); the leaving worker gets rank -1 and exits by itself, and the
  driver does not count that exit as a failure, so nothing is blacklisted.
* **handover** when the node runs the driver (it must stop it and resign, and a new driver's
  world restores the quiesce snapshot) or the world cannot shrink without it (the last node:
  also a store checkpoint, so a cold restart resumes at that step). The workers quiesce at a
  commit through the broadcast Horovod already makes there (`quiesce.py`).
"""

from __future__ import annotations

from typing import Any

from elasticyolo.agent.state import SERVING_STATES
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.registry import read_nodes
from elasticyolo.engines.base import STOP, DrainMode, DrainPlan, DrainSituation, Quiesce


def plan_drain(s: DrainSituation) -> DrainPlan:
    """Pure: the plan for a node in situation `s`."""
    if not s.has_work:
        return STOP
    last = s.other_slots < s.needed_slots
    if s.runs_coordinator or last:
        term = s.coordinator_term if s.runs_coordinator else None
        return DrainPlan(DrainMode.HANDOVER, last_node=last,
                         quiesce=Quiesce(checkpoint=last, hold=s.runs_coordinator, term=term))
    return DrainPlan(DrainMode.LEAVE)


def other_serving_slots(client: Any, keys: JobKeys, node_id: str, max_slots: int) -> int:
    """Slots the other serving nodes offer the world (their warm slots when they report them)."""
    total = 0
    for rec, _ in read_nodes(client, keys):
        if rec.node_id != node_id and rec.state in SERVING_STATES:
            ready = rec.extra.get("ready_slots")
            total += min(int(rec.slots if ready is None else ready), max_slots)
    return total
