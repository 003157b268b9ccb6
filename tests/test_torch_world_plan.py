"""The torch engine's world decisions (engines/torch/world_plan.py), stepped as scenarios: each
step applies what the workers would write after the world the plan published."""

from __future__ import annotations

from dataclasses import replace

from elasticyolo.engines.torch.world_plan import MemberRecord, World, WorldInputs, plan_world


def rec(member: str, **kw: object) -> MemberRecord:
    return MemberRecord(member=member, node=member.split(".")[0], handle=f"h-{member}-0", **kw)  # type: ignore[arg-type]


def entered(records: dict[str, MemberRecord], world: World) -> dict[str, MemberRecord]:
    """Every member of `world` got in (its handle changes, as torch's does)."""
    out = dict(records)
    for m in world.members:
        out[m] = replace(out[m], tried=world.uuid, entered=True, handle=f"h-{m}-{world.uuid}")
    return out


def test_first_world_waits_for_min_nodes_then_a_joiner_is_added_after_the_survivors() -> None:
    records = {"a.0.1": rec("a.0.1")}
    assert plan_world(WorldInputs(None, records, min_nodes=2)) is None
    records["b.0.2"] = rec("b.0.2")
    w1 = plan_world(WorldInputs(None, records, min_nodes=2))
    assert w1 is not None and (w1.uuid, w1.members) == (1, ("a.0.1", "b.0.2"))
    records = entered(records, w1)
    assert plan_world(WorldInputs(w1, records, min_nodes=2)) is None  # nothing changed
    records["c.0.3"] = rec("c.0.3")
    w2 = plan_world(WorldInputs(w1, records, min_nodes=2))
    assert w2 is not None and w2.members == ("a.0.1", "b.0.2", "c.0.3") and not w2.abort
    assert w2.handles == ("h-a.0.1-1", "h-b.0.2-1", "h-c.0.3-0")  # each member's current handle


def test_a_world_still_forming_blocks_the_next_until_a_member_is_gone() -> None:
    records = {m: rec(m) for m in ("a.0.1", "b.0.2")}
    w1 = plan_world(WorldInputs(None, records))
    assert w1 is not None
    records["a.0.1"] = replace(records["a.0.1"], tried=1, entered=True, handle="h-a-1")
    records["c.0.3"] = rec("c.0.3")
    # b has not written its handle for world 1 yet: a world planned now would carry its old one.
    assert plan_world(WorldInputs(w1, records)) is None
    # b's node dies while world 1 forms: world 1 can never form; the next one does, at once,
    # with b's old handle left out and a rolled over as a survivor.
    w2 = plan_world(WorldInputs(w1, records, lost_nodes=frozenset({"b"})))
    assert w2 is not None and w2.members == ("a.0.1", "c.0.3") and w2.abort


def test_a_lost_node_is_removed_with_an_abort_and_an_exited_worker_without() -> None:
    records = {m: rec(m) for m in ("a.0.1", "b.0.2", "c.0.3")}
    w1 = plan_world(WorldInputs(None, records))
    assert w1 is not None
    records = entered(records, w1)
    frozen = plan_world(WorldInputs(w1, records, lost_nodes=frozenset({"c"})))
    assert frozen is not None and frozen.members == ("a.0.1", "b.0.2") and frozen.abort
    del records["b.0.2"]  # b's worker exited: its launcher deleted the record
    exited = plan_world(WorldInputs(w1, records))
    assert exited is not None and exited.members == ("a.0.1", "c.0.3") and not exited.abort


def test_a_dead_nodes_record_never_makes_it_a_joiner_and_a_leaver_is_left_out() -> None:
    records = {m: rec(m) for m in ("a.0.1", "b.0.2")}
    w1 = plan_world(WorldInputs(None, records))
    assert w1 is not None
    records = entered(records, w1)
    w2 = plan_world(WorldInputs(w1, records, lost_nodes=frozenset({"b"}), absent_nodes=frozenset({"b"})))
    assert w2 is not None and w2.members == ("a.0.1",)
    records = entered(records, w2)
    # b is no longer lost (the grace ran out of memory, a new leader), but its node has no record:
    # its worker record is a dead one's, not a joiner's.
    assert plan_world(WorldInputs(w2, records, absent_nodes=frozenset({"b"}))) is None
    records["a.0.1"] = replace(records["a.0.1"], leaving=True)
    assert plan_world(WorldInputs(w2, records, absent_nodes=frozenset({"b"}), min_nodes=1)) is None  # nobody left


def test_a_lease_lapse_that_registers_again_costs_nothing() -> None:
    """A node whose record went and came back is not lost (the coordinator's grace): the plan sees
    the same members and keeps the world."""
    records = {m: rec(m) for m in ("a.0.1", "b.0.2")}
    w1 = plan_world(WorldInputs(None, records))
    assert w1 is not None
    records = entered(records, w1)
    assert plan_world(WorldInputs(w1, records, absent_nodes=frozenset({"b"}))) is None


def test_max_nodes_caps_joiners_by_node() -> None:
    records = {m: rec(m) for m in ("a.0.1", "a.1.2", "b.0.3", "c.0.4")}
    w1 = plan_world(WorldInputs(None, records, max_nodes=2))
    assert w1 is not None and w1.members == ("a.0.1", "a.1.2", "b.0.3")  # both of a's slots, then b
    records = entered(records, w1)
    assert plan_world(WorldInputs(w1, records, max_nodes=2)) is None  # c waits for room
    w2 = plan_world(WorldInputs(w1, records, max_nodes=2, lost_nodes=frozenset({"b"})))
    assert w2 is not None and w2.members == ("a.0.1", "a.1.2", "c.0.4")


def test_a_missing_node_record_counts_as_gone_only_after_the_grace() -> None:
    from elasticyolo.engines.torch.coordinator import CoordinatorMemory, nodes_gone

    memory = CoordinatorMemory()
    assert nodes_gone({"a"}, {"a", "b"}, memory, now=10.0, grace_s=4.0) == set()  # b missing from 10.0
    assert nodes_gone({"a"}, {"a", "b"}, memory, now=13.9, grace_s=4.0) == set()
    assert nodes_gone({"a", "b"}, {"a", "b"}, memory, now=13.95, grace_s=4.0) == set()  # b registered again
    assert nodes_gone({"a"}, {"a", "b"}, memory, now=14.0, grace_s=4.0) == set()  # its grace starts over
    assert nodes_gone({"a"}, {"a", "b"}, memory, now=18.0, grace_s=4.0) == {"b"}
