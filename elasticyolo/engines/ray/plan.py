"""What the Ray job controller does next (pure; applied by `controller.py`, stepped in
`tests/test_ray_plan.py`). Which workers form each world is the torch engine's `plan_world`; this
is the cluster side: which nodes the job holds, where training actors start, which nodes it lets go.

The job holds a node through a placement group of `slots` bundles packed on that node (one
training actor per bundle). It asks for one more node at a time while it holds fewer than
`max_nodes`: one pending placement group that no held or drained node may take (a label selector
on Ray's node id), which Ray places on the first node with room, and which an autoscaler sees as
demand.

* a held node whose Ray node died (Ray's node table), that stopped answering while its world's
  collective failed, or whose actor's process ended without its raylet saying so (`lost`), is let
  go: its placement group removed, its actors killed; its
  members are lost to `plan_world`;
* a draining node (a spot notice) gets no new actor; its actors are asked to leave once, at their
  next commit; when none is left it is let go;
* an actor that died on a live node is replaced in its bundle (a worker crash, not a node loss);
* a finished actor is not replaced.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping


class Slot(str, enum.Enum):
    EMPTY = "empty"  # no actor (never started, or it died: start one)
    RUNNING = "running"  # an actor is starting or training
    LEAVING = "leaving"  # asked to leave
    ENDED = "ended"  # its actor returned (left, finished): never replaced


@dataclass(frozen=True)
class HeldNode:
    ray_node_id: str
    slots: tuple[Slot, ...]
    draining: bool = False
    lost: bool = False  # found gone before Ray's health checks say so (`controller.py`)


@dataclass(frozen=True)
class ClusterInputs:
    held: Mapping[str, HeldNode]  # by the job's node name
    alive: frozenset[str]  # Ray node ids Ray says are alive
    pending: bool  # a placement group is waiting for a node
    max_nodes: int
    ended: bool = False  # the job is over (done, failed or cancelled)


@dataclass(frozen=True)
class ClusterActions:
    ask_for_node: bool = False  # create the pending placement group
    start: tuple[tuple[str, int], ...] = ()  # (node, slot): start a training actor there
    leave: tuple[tuple[str, int], ...] = ()  # (node, slot): ask its actor to leave at a commit
    release: tuple[str, ...] = ()  # nodes to let go
    lost: frozenset[str] = field(default_factory=frozenset)  # nodes whose members are lost (plan_world)


def plan_cluster(inp: ClusterInputs) -> ClusterActions:
    if inp.ended:
        return ClusterActions(release=tuple(sorted(inp.held)), lost=frozenset(inp.held))
    start, leave, release, lost = [], [], [], set()
    for name, node in sorted(inp.held.items()):
        if node.ray_node_id not in inp.alive or node.lost:
            release.append(name)
            lost.add(name)
            continue
        if node.draining:
            leave += [(name, i) for i, s in enumerate(node.slots) if s is Slot.RUNNING]
            if all(s in (Slot.EMPTY, Slot.ENDED) for s in node.slots):
                release.append(name)
            continue
        start += [(name, i) for i, s in enumerate(node.slots) if s is Slot.EMPTY]
    serving = [n for n, node in inp.held.items() if n not in release and not node.draining]
    ask = not inp.pending and len(serving) < inp.max_nodes
    return ClusterActions(ask_for_node=ask, start=tuple(start), leave=tuple(leave), release=tuple(release),
                          lost=frozenset(lost))


def node_name(ray_node_id: str) -> str:
    """The job's name for a Ray node (the first 12 hex digits of its id: unique in practice)."""
    return ray_node_id[:12]
