"""`engines/torch/membership.py` decisions: the torch rendezvous follows the cluster's membership."""

from __future__ import annotations

from elasticyolo.engines.torch.membership import Member, decide

M = {"h_1_0": Member("a", 10), "h_2_0": Member("b", 11), "h_3_0": Member("c", 12)}


def step(participants: set[str], known: set[str], live: set[str], members: dict[str, Member] = M,
         complete: bool = False, deadline_set: bool = True, min_nodes: int = 1):  # type: ignore[no-untyped-def]
    return decide(participants=participants, known=known, complete=complete, deadline_set=deadline_set,
                  min_nodes=min_nodes, members=members, live_nodes=live)


def test_a_dead_nodes_participant_expires_and_the_survivors_complete_at_once() -> None:
    # c's agent died (its lease revoked): a and b re-joined; nobody else can come.
    d = step({"h_1_0", "h_2_0"}, {"h_1_0", "h_2_0", "h_3_0"}, live={"a", "b"})
    assert d.expire == {"h_3_0"} and d.complete_now


def test_a_complete_round_that_lost_a_participant_is_replaced_by_the_next_at_once() -> None:
    # a, b and c formed a round; c's node is gone: the survivors need not leave it one by one.
    d = step({"h_1_0", "h_2_0", "h_3_0"}, {"h_1_0", "h_2_0", "h_3_0"}, live={"a", "b"}, complete=True)
    assert d.expire == {"h_3_0"} and d.next_round and not d.complete_now
    # Nobody gone, or the round still forming (torch's sanitizer drops the participant): no jump.
    assert not step({"h_1_0", "h_2_0"}, {"h_1_0", "h_2_0"}, live={"a", "b"}, complete=True).next_round
    assert not step({"h_1_0", "h_3_0"}, {"h_1_0", "h_3_0"}, live={"a", "b"}).next_round
    # As the state holder calls it: participants and known as one-shot iterators.
    it = decide(participants=iter(["h_1_0", "h_2_0", "h_3_0"]), known=iter(["h_1_0", "h_2_0", "h_3_0"]),
                complete=True, deadline_set=False, min_nodes=1, members=M, live_nodes={"a", "b"})
    assert it.expire == {"h_3_0"} and it.next_round
    # A gone node that is only in the wait list does not end the running round.
    assert not step({"h_1_0", "h_2_0"}, {"h_1_0", "h_2_0", "h_3_0"}, live={"a", "b"}, complete=True).next_round


def test_the_round_waits_for_a_live_node_that_has_not_joined_yet() -> None:
    d = step({"h_1_0"}, {"h_1_0", "h_2_0"}, live={"a", "b", "c"})
    assert not d.expire and not d.complete_now


def test_a_joiner_in_the_wait_list_is_waited_for_then_completes() -> None:
    members = {**M, "h_4_0": Member("d", 20)}
    known = {"h_1_0", "h_2_0", "h_4_0"}
    assert not step({"h_1_0", "h_2_0"}, known, {"a", "b", "d"}, members).complete_now
    assert step({"h_1_0", "h_2_0", "h_4_0"}, known, {"a", "b", "d"}, members).complete_now


def test_a_restarted_launcher_supersedes_its_older_self() -> None:
    members = {**M, "h_9_0": Member("b", 30)}  # b's launcher restarted: new pid, newer revision
    d = step({"h_1_0", "h_9_0"}, {"h_1_0", "h_2_0", "h_9_0"}, {"a", "b"}, members)
    assert d.expire == {"h_2_0"} and d.complete_now


def test_unknown_participants_keep_torchs_rules() -> None:
    # A participant with no member key (plain torchrun) is never expired and blocks early completion.
    d = step({"h_1_0", "x_5_0"}, {"h_1_0", "x_5_0"}, live={"a"})
    assert not d.expire and not d.complete_now


def test_nothing_to_do_before_min_nodes_without_deadline_or_when_complete() -> None:
    assert not step({"h_1_0"}, {"h_1_0"}, {"a"}, min_nodes=2).complete_now
    assert not step({"h_1_0"}, {"h_1_0"}, {"a"}, deadline_set=False).complete_now
    assert not step({"h_1_0"}, {"h_1_0"}, {"a"}, complete=True).complete_now


def test_a_live_launcher_not_yet_in_the_state_is_expected() -> None:
    # d's launcher registered (its workers are warm) but has not reached the wait list yet.
    members = {**M, "h_4_0": Member("d", 20)}
    d = step({"h_1_0", "h_2_0", "h_3_0"}, {"h_1_0", "h_2_0", "h_3_0"}, {"a", "b", "c", "d"}, members)
    assert not d.complete_now


def test_the_first_round_expects_every_live_node() -> None:
    # At the job's start, a node still warming up (no member key yet) is waited for (until the last call).
    start = decide(participants={"h_1_0", "h_2_0"}, known={"h_1_0", "h_2_0"}, complete=False, deadline_set=True,
                   min_nodes=1, members=M, live_nodes={"a", "b", "c"}, first_round=True)
    assert not start.complete_now
    later = decide(participants={"h_1_0", "h_2_0"}, known={"h_1_0", "h_2_0"}, complete=False, deadline_set=True,
                   min_nodes=1, members={k: M[k] for k in ("h_1_0", "h_2_0")}, live_nodes={"a", "b", "c"})
    assert later.complete_now  # c's launcher is not in the rendezvous: not waited for


def test_a_launcher_that_left_is_expired_at_once_while_its_node_lives() -> None:
    # c drained on a spot notice: its launcher stopped and marked its key left; c's agent (and
    # its node record) lives until the kill. Its heartbeat is still in the state: without the
    # marker the survivors' round waited for torch's heartbeat expiry (15 s).
    members = {**M, "h_3_0": Member("c", 12, left=True)}
    d = step({"h_1_0", "h_2_0"}, {"h_1_0", "h_2_0", "h_3_0"}, live={"a", "b", "c"}, members=members)
    assert d.expire == {"h_3_0"} and d.complete_now
    # The running round that c was in is replaced at once.
    d = step({"h_1_0", "h_2_0", "h_3_0"}, {"h_1_0", "h_2_0", "h_3_0"}, live={"a", "b", "c"}, members=members,
             complete=True)
    assert d.next_round


def test_a_late_left_marker_does_not_supersede_the_nodes_new_launcher() -> None:
    # b's old launcher wrote its marker after b's new launcher registered (a newer revision).
    members = {**M, "h_2_0": Member("b", 40, left=True), "h_9_0": Member("b", 30)}
    d = step({"h_1_0", "h_3_0", "h_9_0"}, {"h_1_0", "h_2_0", "h_3_0", "h_9_0"}, {"a", "b", "c"}, members)
    assert d.expire == {"h_2_0"} and d.complete_now


def test_the_view_marks_a_member_left_and_reads_it_back() -> None:
    from elasticyolo.cluster.keys import JobKeys
    from elasticyolo.engines.torch.membership import RendezvousView

    class Kv:
        def __init__(self) -> None:
            self.data: dict[str, tuple[bytes, int]] = {}
            self.rev = 0

        def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]:
            return [(k, v, r) for k, (v, r) in sorted(self.data.items()) if k.startswith(prefix)]

        def put(self, key: str, value: bytes | str, lease: int | None = None) -> int:
            self.rev += 1
            self.data[key] = (value.encode() if isinstance(value, str) else value, self.rev)
            return self.rev

    keys = JobKeys("j")
    kv = Kv()
    view = RendezvousView(kv, "rdzv/members/", keys)  # type: ignore[arg-type]
    kv.put(keys.nodes + "a", "{}")
    view.register("h_1_0", "a")
    assert view.read() == ({"h_1_0": Member("a", 2)}, {"a"})
    view.leave("h_1_0", "a")
    assert view.read()[0] == {"h_1_0": Member("a", 3, left=True)}
