"""The driver's decision once a reset's workers are all recorded (engines/horovod/round_policy.py),
stepped round by round: churn never blacklists a healthy host nor ends the job."""

from __future__ import annotations

from elasticyolo.engines.horovod.round_policy import (FAILURE, READY, SUCCESS, CrashHistory, decide_round,
                                                      is_crash)


def states(**by_host: str) -> dict[tuple[str, int], str]:
    return {(h, 0): s for h, s in by_host.items()}


def test_lost_and_stopped_workers_blacklist_nothing_and_never_end_the_job() -> None:
    history = CrashHistory()
    for n in range(10):  # ten rounds in a row, every worker FAILURE, none of them a crash
        d = decide_round(states(n1=FAILURE, n2=FAILURE, n3=FAILURE), set(), history, n, None)
        assert d.action == "resume" and not d.blacklist


def test_a_host_that_alone_crashes_twice_in_a_row_is_blacklisted() -> None:
    history = CrashHistory()
    d = decide_round(states(n1=READY, n2=FAILURE), {("n2", 0)}, history, 0, None)
    assert d.action == "resume" and not d.blacklist  # once may be bad luck
    d = decide_round(states(n1=READY, n2=FAILURE), {("n2", 0)}, history, 1, None)
    assert d.action == "resume" and d.blacklist == {"n2"}
    # a round without its crash starts the count again
    history = CrashHistory()
    decide_round(states(n1=READY, n2=FAILURE), {("n2", 0)}, history, 0, None)
    decide_round(states(n1=READY, n2=READY), set(), history, 1, None)
    d = decide_round(states(n1=READY, n2=FAILURE), {("n2", 0)}, history, 2, None)
    assert not d.blacklist


def test_a_crash_everywhere_is_no_evidence_against_a_host_but_repeated_it_fails_the_job() -> None:
    history = CrashHistory()
    crashed = {("n1", 0), ("n2", 0)}
    for n in range(2):
        d = decide_round(states(n1=FAILURE, n2=FAILURE), crashed, history, n, None)
        assert d.action == "resume" and not d.blacklist
    d = decide_round(states(n1=FAILURE, n2=FAILURE), crashed, history, 2, None,
                     crash_reason="n1: data.yaml not found: /data/x.yaml")
    assert d.action == "fail" and "3 resets in a row" in (d.reason or "") and "data.yaml not found" in (d.reason or "")


def test_success_finishes_and_reset_limit_fails() -> None:
    assert decide_round(states(n1=SUCCESS, n2=READY), set(), CrashHistory(), 0, None).action == "finish"
    d = decide_round(states(n1=READY), set(), CrashHistory(), 5, 5)
    assert d.action == "fail" and "reset_limit" in (d.reason or "")


def test_what_counts_as_a_crash() -> None:
    assert is_crash(1) and is_crash(-6) and is_crash(-11)
    assert not is_crash(0) and not is_crash(-15) and not is_crash(-9) and not is_crash(143) and not is_crash(75)
