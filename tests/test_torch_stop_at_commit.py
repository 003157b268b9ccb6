"""A torch-elastic round ends at a commit (`engines/torch/stop_at_commit.py`), stepped with fakes:
SIGTERM asks, the ranks agree at the next commit, every rank stops there with that commit's
snapshot on disk; a rank that reaches no commit in time stops the old way."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

pytest.importorskip("torch")

from elasticyolo.engines.torch.stop_at_commit import EXIT_PEER_STOPPED, EXIT_SIGTERM, StopAtCommit  # noqa: E402


class Exited(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def _exit(code: int) -> None:
    raise Exited(code)


@dataclass
class _Progress:
    step: int


@dataclass
class _Core:
    progress: _Progress


@dataclass
class _Snapshots:
    submitted_step: int
    calls: list[Any] = field(default_factory=list)

    def save_now(self, core: Any, timeout: float | None = None) -> bool:
        self.calls.append(("save_now", core.progress.step))
        self.submitted_step = core.progress.step
        return True

    def flush(self, timeout: float | None = None) -> bool:
        self.calls.append(("flush",))
        return True


def _stop(step: int = 7, submitted: int = 7, peers_asking: int = 0, wait_s: float = 5.0):
    snaps = _Snapshots(submitted)
    reduced: list[int] = []

    def reduce(flag: int) -> int:
        reduced.append(flag)
        return flag + peers_asking

    return StopAtCommit(_Core(_Progress(step)), reduce, snaps, wait_s=wait_s, exit=_exit), snaps, reduced


def test_nobody_asked_training_goes_on() -> None:
    stop, snaps, reduced = _stop()
    stop.check()
    assert reduced == [0] and snaps.calls == []


def test_a_sigterm_stops_every_rank_at_the_next_commit_with_its_snapshot_on_disk() -> None:
    stop, snaps, reduced = _stop()
    answer: list[bool] = []
    asking = threading.Thread(target=lambda: answer.append(stop.request()))
    asking.start()
    assert stop.requested.wait(5)
    with pytest.raises(Exited) as out:
        stop.check()
    asking.join(5)
    assert out.value.code == EXIT_SIGTERM and reduced == [1]
    assert snaps.calls == [("flush",)]  # this commit's snapshot was submitted: only waited for
    assert answer == [True]  # the SIGTERM watcher leaves the exit to the main thread


def test_a_rank_stops_when_a_peer_asked_and_says_so() -> None:
    stop, snaps, reduced = _stop(peers_asking=1)
    with pytest.raises(Exited) as out:
        stop.check()
    assert out.value.code == EXIT_PEER_STOPPED and reduced == [0]


def test_a_commit_the_snapshot_period_skipped_is_snapshotted_before_the_stop() -> None:
    stop, snaps, _ = _stop(step=9, submitted=7, peers_asking=1)
    with pytest.raises(Exited):
        stop.check()
    assert snaps.calls == [("save_now", 9), ("flush",)]


def test_no_commit_in_time_leaves_the_stop_to_the_sigterm_watcher() -> None:
    stop, _, _ = _stop(wait_s=0.2)
    assert stop.request() is False  # the caller flushes the snapshot in flight and exits at once


def test_a_rank_waiting_at_a_commit_for_slower_peers_is_not_cut_short_by_the_deadline() -> None:
    in_reduce, answer_now = threading.Event(), threading.Event()
    snaps = _Snapshots(7)

    def slow_reduce(flag: int) -> int:  # rank 0 reaches the commit after this rank's deadline
        in_reduce.set()
        answer_now.wait(10)
        return flag

    stop = StopAtCommit(_Core(_Progress(7)), slow_reduce, snaps, wait_s=0.1, exit=_exit)
    answer: list[bool] = []
    stop.requested.set()
    main = threading.Thread(target=lambda: pytest.raises(Exited, stop.check))
    main.start()
    assert in_reduce.wait(5)
    asking = threading.Thread(target=lambda: answer.append(stop.request()))
    asking.start()
    asking.join(0.5)
    assert asking.is_alive()  # past its deadline, still waiting on the answer
    answer_now.set()
    asking.join(5)
    main.join(5)
    assert answer == [True]


def test_a_failed_answer_leaves_the_stop_to_the_sigterm_watcher() -> None:
    def failing_reduce(flag: int) -> int:
        raise RuntimeError("Connection closed by peer")

    stop = StopAtCommit(_Core(_Progress(7)), failing_reduce, _Snapshots(7), wait_s=0.1, exit=_exit)
    stop.requested.set()
    with pytest.raises(RuntimeError):
        stop.check()
    assert stop.request() is False


def test_a_rank_waiting_at_a_commit_on_a_frozen_peer_stops_the_old_way_after_the_grace() -> None:
    from elasticyolo.engines.torch.stop_at_commit import AT_COMMIT_GRACE_S

    in_reduce = threading.Event()

    def frozen_reduce(flag: int) -> int:  # a SIGSTOPped peer never answers
        in_reduce.set()
        threading.Event().wait(30)
        return flag

    stop = StopAtCommit(_Core(_Progress(7)), frozen_reduce, _Snapshots(7), wait_s=0.1, exit=_exit)
    threading.Thread(target=stop.check, daemon=True).start()
    assert in_reduce.wait(5)
    t0 = time.monotonic()
    assert stop.request() is False
    assert time.monotonic() - t0 < 0.1 + AT_COMMIT_GRACE_S + 1.0
