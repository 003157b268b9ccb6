"""The crash-loop rule (engines/crash_loop.py), stepped check by check: a job fails only when every
serving node's workers crash in a loop; churn and training progress end the streaks."""

from __future__ import annotations

from elasticyolo.engines.crash_loop import (ALL_CRASH_LIMIT, CrashLoopState, CrashTally, NodeCrashes, judge,
                                            streak)
from elasticyolo.engines.horovod import round_policy

GEN = 7


def setup(n: int) -> NodeCrashes:
    return NodeCrashes(setup=n)


def joined(n: int) -> NodeCrashes:
    return NodeCrashes(joined=n)


def test_the_engines_share_one_limit() -> None:
    assert round_policy.ALL_CRASH_LIMIT is ALL_CRASH_LIMIT


def test_every_node_failing_in_setup_fails_the_job_at_the_limit() -> None:
    s = CrashLoopState()
    for n in range(ALL_CRASH_LIMIT):
        v = judge(s, GEN, {"a": setup(n), "b": setup(n)}, None)
        assert not v.fail, (n, v)
    v = judge(s, GEN, {"a": setup(3), "b": setup(3)}, None)
    assert v.fail and v.streaks == {"a": 3, "b": 3}
    assert v.reason == "every worker crashed 3 times in a row before the first step"


def test_one_node_that_does_not_crash_keeps_the_job() -> None:
    s = CrashLoopState()
    judge(s, GEN, {"a": setup(0), "b": setup(0)}, None)
    v = judge(s, GEN, {"a": setup(9), "b": setup(0)}, None)
    assert not v.fail and v.streaks == {"a": 9, "b": 0}


def test_training_further_than_ever_ends_every_streak() -> None:
    s = CrashLoopState()
    judge(s, GEN, {"a": joined(0), "b": joined(0)}, 10)
    assert not judge(s, GEN, {"a": joined(2), "b": joined(2)}, 10).fail
    v = judge(s, GEN, {"a": joined(2), "b": joined(2)}, 11)  # a step past 10
    assert v.streaks == {"a": 0, "b": 0}
    assert not judge(s, GEN, {"a": joined(4), "b": joined(4)}, 11).fail
    assert judge(s, GEN, {"a": joined(5), "b": joined(5)}, 11).fail


def test_a_crash_at_the_same_step_every_time_fails_the_job() -> None:
    """Restored from a snapshot, the world steps again up to the crash: steps below the highest
    seen are no progress."""
    s = CrashLoopState()
    judge(s, GEN, {"a": joined(0)}, 50)
    for n, step in ((1, 46), (2, 50), (3, 48)):
        v = judge(s, GEN, {"a": joined(n)}, step)
    assert v.fail and v.reason == "every worker crashed 3 times in a row without passing step 50"


def test_a_node_killed_mid_run_does_not_fail_the_job() -> None:
    """The survivors' workers fail in their collectives when a peer dies: the membership change
    ends those streaks, and the re-formed world's training ends the rest."""
    s = CrashLoopState()
    judge(s, GEN, {"a": joined(0), "b": joined(0), "c": joined(0)}, 100)
    # c is killed: a and b fail in a collective, before or after c's record goes.
    assert not judge(s, GEN, {"a": joined(1), "b": joined(1), "c": joined(0)}, 100).fail
    v = judge(s, GEN, {"a": joined(2), "b": joined(2)}, 100)  # c gone
    assert v.streaks == {"a": 0, "b": 0}
    # Churn again and again, each change costing the survivors a failure: still no failure.
    for k in range(10):
        members = {"a": joined(3 + k), "b": joined(3 + k)} | ({"c": joined(0)} if k % 2 == 0 else {})
        assert not judge(s, GEN, members, 100).fail, k
    # The world trains: every streak ends.
    assert judge(s, GEN, {"a": joined(20), "b": joined(20)}, 101).streaks == {"a": 0, "b": 0}


def test_setup_failures_are_a_nodes_own_and_survive_churn() -> None:
    """A worker that failed before reaching a peer was not failed by churn: a missing data path
    fails the job even while nodes come and go."""
    s = CrashLoopState()
    judge(s, GEN, {"a": setup(1), "b": setup(1)}, None)
    judge(s, GEN, {"a": setup(2), "b": setup(2), "c": setup(0)}, None)  # c joins
    v = judge(s, GEN, {"a": setup(4), "b": setup(4)}, None)  # c leaves again
    assert v.streaks == {"a": 3, "b": 3} and v.fail


def test_a_newcomer_starts_from_its_current_counts() -> None:
    s = CrashLoopState()
    judge(s, GEN, {"a": setup(2)}, None)
    v = judge(s, GEN, {"a": setup(3), "b": setup(5)}, None)
    assert v.streaks == {"a": 1, "b": 0} and not v.fail  # a: counted from the first check


def test_a_new_submission_starts_over() -> None:
    s = CrashLoopState()
    judge(s, GEN, {"a": setup(0)}, 5)
    judge(s, GEN, {"a": setup(2)}, 5)
    v = judge(s, GEN + 1, {"a": setup(0)}, 5)
    assert v.streaks == {"a": 0} and s.high_step == 5
    assert not judge(s, GEN + 1, {"a": setup(2)}, 5).fail


def test_no_serving_node_fails_nothing() -> None:
    assert not judge(CrashLoopState(), GEN, {}, None).fail


def test_streak_never_goes_negative() -> None:
    assert streak(NodeCrashes(0, 0), NodeCrashes(2, 2)) == 0


# ---- the node's tally -------------------------------------------------------------------------
def rec(pid: int, round_key: str | None, joined: bool | None = False, generation: int = GEN) -> dict[str, object]:
    out: dict[str, object] = {"pid": pid, "at": float(pid), "round": round_key, "generation": generation,
                              "reason": "x"}
    if joined is not None:
        out["joined"] = joined
    return out


def test_a_rounds_slots_count_once() -> None:
    t = CrashTally()
    assert t.add(rec(1, "900:0"))
    assert not t.add(rec(2, "900:0"))  # the other slot of the same round
    assert t.add(rec(3, "900:1", joined=True))
    assert t.add(rec(4, None))  # a warm worker before its round
    assert t.counts() == NodeCrashes(setup=2, joined=1)
    assert t.as_record() == {"generation": GEN, "setup": 2, "joined": 1}
    assert NodeCrashes.from_record(t.as_record(), GEN) == NodeCrashes(2, 1)
    assert NodeCrashes.from_record(t.as_record(), GEN + 1) == NodeCrashes()


def test_a_record_that_does_not_say_counts_as_joined() -> None:
    t = CrashTally()
    t.add(rec(1, None, joined=None))  # e.g. a signal death the agent saw
    assert t.counts() == NodeCrashes(joined=1)


def test_a_new_submission_resets_the_tally() -> None:
    t = CrashTally()
    t.add(rec(1, "9:0"))
    t.add(rec(2, "9:0", generation=GEN + 1))
    assert t.as_record() == {"generation": GEN + 1, "setup": 1, "joined": 0}
