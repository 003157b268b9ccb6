"""Which workers form the torch engine's next world (pure; applied by `coordinator.py`).

The torch engine keeps its worker processes across world changes: the survivors re-form their
process group in place (torch's Gloo reconfiguration, `worker.py`), and only a joiner or a
replacement is a new process. Each worker publishes a member record (`MemberRecord`) with its
reconfiguration handle, which changes every time it joins a world; the leader's coordinator
publishes each world (`World`): its id (the reconfiguration uuid) and its members in rank order,
with their handles.

`plan_world` decides, from explicit state, whether a new world is due and which:
* a member leaves the world when its record is gone (its worker exited: its node's launcher
  deletes it) or its node is lost (the coordinator decides that: `coordinator.py`). A node whose
  lease lapsed and that registered again is not lost, so its worker stays;
* a joiner is a ready record not in the world (a new node, a replacement worker, a member that
  failed to enter the last world) whose node has a record now (a dead node's worker records stay
  behind it);
* survivors keep their order, so rank 0 stays where it was; joiners come after them;
* no world forms below `min_nodes` or above `max_nodes` (counted in nodes). While every member
  of the current world is there, none forms until each has published the handle of that world
  (the handle in its record changes when it gets in). Once a member is gone, the current world
  can never form, so the others' recorded handles stay theirs: the next world forms at once, and
  a member still trying to enter the current one gives up as soon as it is out.
`abort` tells the survivors to abort the collective they are in: set when a member was lost
(a frozen node never closes its connections); a worker that exited closed its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping


@dataclass(frozen=True)
class MemberRecord:
    """A worker's record (`<job>/torch/members/<node>.<slot>`)."""

    member: str  # `<node>.<slot>.<incarnation>`: one worker process, never reused
    node: str
    handle: str  # its current reconfiguration handle
    tried: int = 0  # the last world it tried to enter (0: none yet)
    entered: bool = False  # whether it is in world `tried`
    leaving: bool = False  # it asked to leave (drain, stop): never put in a new world
    failed: int = 0  # the last world whose collective failed on it (0: none)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "MemberRecord":
        return cls(member=str(data["member"]), node=str(data["node"]), handle=str(data["handle"]),
                   tried=int(data.get("tried", 0)), entered=bool(data.get("entered", False)),
                   leaving=bool(data.get("leaving", False)), failed=int(data.get("failed", 0)))

    def to_json(self) -> dict[str, Any]:
        return {"member": self.member, "node": self.node, "handle": self.handle, "tried": self.tried,
                "entered": self.entered, "leaving": self.leaving, "failed": self.failed}


@dataclass(frozen=True)
class World:
    uuid: int
    members: tuple[str, ...]
    handles: tuple[str, ...]
    nodes: tuple[str, ...]  # each member's node, in rank order
    abort: bool = False
    reason: str = ""

    @property
    def size(self) -> int:
        return len(self.members)

    def ranks(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {}
        for rank, node in enumerate(self.nodes):
            out.setdefault(node, []).append(rank)
        return out

    def to_json(self) -> dict[str, Any]:
        # `world_size` and `ranks` are the fields every engine's world record has (status, tests).
        return {"uuid": self.uuid, "members": list(self.members), "handles": list(self.handles),
                "nodes": list(self.nodes), "abort": self.abort, "reason": self.reason,
                "world_size": self.size, "ranks": self.ranks()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "World | None":
        """None for a record another engine wrote (no `uuid`)."""
        if "uuid" not in data or "members" not in data:
            return None
        return cls(uuid=int(data["uuid"]), members=tuple(data["members"]), handles=tuple(data["handles"]),
                   nodes=tuple(data["nodes"]), abort=bool(data.get("abort", False)),
                   reason=str(data.get("reason", "")))


@dataclass(frozen=True)
class WorldInputs:
    current: World | None
    records: Mapping[str, MemberRecord]  # by member id
    lost_nodes: frozenset[str] = field(default_factory=frozenset)
    absent_nodes: frozenset[str] = field(default_factory=frozenset)  # no node record now: no joiner from them
    min_nodes: int = 1
    max_nodes: int = 1 << 20


def _nodes(members: Iterable[str], records: Mapping[str, MemberRecord]) -> set[str]:
    return {records[m].node for m in members}


def plan_world(inp: WorldInputs) -> World | None:
    """The next world, or None when the current one stands (or none can form yet)."""
    cur, records = inp.current, inp.records
    usable = {m: r for m, r in records.items() if r.node not in inp.lost_nodes and not r.leaving}
    can_join = [m for m, r in usable.items() if r.node not in inp.absent_nodes]
    if cur is None:
        return _capped(1, [], sorted(can_join), usable, inp, abort=False, reason="first world")
    gone = [m for m in cur.members if m not in usable]
    pending = [m for m in cur.members if m in usable and usable[m].tried < cur.uuid]
    if pending and not gone:
        return None  # a member has not published its handle for the current world yet
    survivors = [m for m in cur.members if m in usable
                 and (usable[m].tried < cur.uuid or (usable[m].tried == cur.uuid and usable[m].entered))]
    removed = [m for m in cur.members if m not in survivors]
    joiners = sorted(m for m in can_join if m not in survivors)
    if not removed and not joiners:
        return None
    lost = [m for m in removed if m in records and records[m].node in inp.lost_nodes]
    reasons = []
    if removed:
        reasons.append("left: " + ",".join(removed))
    if joiners:
        reasons.append("joined: " + ",".join(joiners))
    world = _capped(cur.uuid + 1, survivors, joiners, usable, inp, abort=bool(lost), reason="; ".join(reasons))
    if world is not None and not removed and world.members == cur.members:
        return None  # every joiner is over max_nodes
    return world


def _capped(uuid: int, survivors: list[str], joiners: list[str], usable: Mapping[str, MemberRecord],
            inp: WorldInputs, *, abort: bool, reason: str) -> World | None:
    members = list(survivors)
    nodes = _nodes(members, usable)
    for m in joiners:  # whole nodes only while under max_nodes
        node = usable[m].node
        if node in nodes or len(nodes) < inp.max_nodes:
            members.append(m)
            nodes.add(node)
    if len(nodes) < max(1, inp.min_nodes):
        return None
    return World(uuid=uuid, members=tuple(members), handles=tuple(usable[m].handle for m in members),
                 nodes=tuple(usable[m].node for m in members), abort=abort, reason=reason)
