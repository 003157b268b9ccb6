"""A torch-elastic round ends at a commit (`engines/torch/stop_at_commit.py`), stepped with fakes:
SIGTERM asks, the ranks agree at the next commit (`agree`, before rank 0's checkpoint), every
rank stops there (`check`, last in it) with that commit's snapshot on disk; a rank that reaches
no commit in time stops the old way."""

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


def _commit(stop: StopAtCommit, between: Any = None) -> None:
    """A commit as `worker_runtime/commit.py` makes it: save, the snapshot, agree, the checkpoint, check."""
    stop.save()
    stop.agree()
    if between is not None:
        between()
    stop.check()


def test_nobody_asked_training_goes_on() -> None:
    stop, snaps, reduced = _stop()
    _commit(stop)
    assert reduced == [0] and snaps.calls == []


def test_a_sigterm_stops_every_rank_at_the_next_commit_with_its_snapshot_on_disk() -> None:
    stop, snaps, reduced = _stop()
    answer: list[bool] = []
    asking = threading.Thread(target=lambda: answer.append(stop.request()))
    asking.start()
    assert stop.requested.wait(5)
    with pytest.raises(Exited) as out:
        _commit(stop)
    asking.join(5)
    assert out.value.code == EXIT_SIGTERM and reduced == [1]
    assert snaps.calls == [("flush",)]  # this commit's snapshot was submitted: only waited for
    assert answer == [True]  # the SIGTERM watcher leaves the exit to the main thread


def test_a_rank_stops_when_a_peer_asked_and_says_so() -> None:
    stop, snaps, reduced = _stop(peers_asking=1)
    with pytest.raises(Exited) as out:
        _commit(stop)
    assert out.value.code == EXIT_PEER_STOPPED and reduced == [0]


def test_a_commit_the_snapshot_period_skipped_is_snapshotted_before_the_stop() -> None:
    stop, snaps, _ = _stop(step=9, submitted=7, peers_asking=1)
    with pytest.raises(Exited):
        _commit(stop)
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
    main = threading.Thread(target=lambda: pytest.raises(Exited, _commit, stop))
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
        _commit(stop)
    assert stop.request() is False


def test_a_rank_waiting_at_a_commit_on_a_frozen_peer_stops_the_old_way_after_the_grace() -> None:
    from elasticyolo.engines.torch.stop_at_commit import AT_COMMIT_GRACE_S

    in_reduce = threading.Event()

    def frozen_reduce(flag: int) -> int:  # a SIGSTOPped peer never answers
        in_reduce.set()
        threading.Event().wait(30)
        return flag

    stop = StopAtCommit(_Core(_Progress(7)), frozen_reduce, _Snapshots(7), wait_s=0.1, exit=_exit)
    threading.Thread(target=_commit, args=(stop,), daemon=True).start()
    assert in_reduce.wait(5)
    t0 = time.monotonic()
    assert stop.request() is False
    assert time.monotonic() - t0 < 0.1 + AT_COMMIT_GRACE_S + 1.0


def test_the_ranks_agree_before_rank_0s_checkpoint_copy_so_a_leaving_rank_is_not_held_by_it() -> None:
    """Seen in a replay: a node leaving on a spot notice waited at the agreement for rank 0's
    0.5-s checkpoint copy, was SIGKILLed by its drain's deadline there, and the survivors saw a
    crash instead of a stop. The agreement now comes first; the stop itself last."""
    stop, snaps, reduced = _stop(peers_asking=1)
    order: list[str] = []
    with pytest.raises(Exited) as out:
        _commit(stop, between=lambda: order.append(f"checkpoint after {len(reduced)} reduce(s)"))
    assert order == ["checkpoint after 1 reduce(s)"] and stop.stopping.is_set()
    assert out.value.code == EXIT_PEER_STOPPED and snaps.calls == [("flush",)]


# ---- the request on the step's gradient all-reduce ------------------------------------------
def test_a_request_rides_on_the_next_gradient_all_reduce_and_makes_that_step_a_commit() -> None:
    import torch

    stop, _, _ = _stop()
    grad = torch.zeros(3)
    assert float(stop.outgoing(grad)[0]) == 0.0
    stop.incoming(torch.tensor([0.0]))  # nobody asked in this step
    assert stop.commit_now() is False
    stop.requested.set()  # SIGTERM here...
    assert float(stop.outgoing(grad)[0]) == 1.0  # ...rides on the next step's all-reduce
    stop.incoming(torch.tensor([1.0]))
    assert stop.commit_now() is True


def test_a_peers_request_makes_the_step_a_commit_here_too() -> None:
    import torch

    stop, _, _ = _stop()
    stop.incoming(torch.tensor([1.0]))  # summed over the ranks: a peer asked
    assert stop.commit_now() is True and not stop.requested.is_set()


def test_a_world_of_one_commits_at_the_step_after_its_own_request() -> None:
    stop, _, _ = _stop()
    stop.world = 1
    assert stop.commit_now() is False
    stop.requested.set()
    assert stop.commit_now() is True


def _rank_main(rank: int, store_path: str, out: Any) -> None:
    import torch
    import torch.distributed as dist

    from elasticyolo.engines.torch.worker import make_allreduce

    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    try:
        stop, _, _ = _stop()
        stop.world = 2
        allreduce = make_allreduce(2, stop=stop)
        grads = [torch.full((2, 2), float(rank + 1)), torch.full((3,), 10.0 * (rank + 1))]
        allreduce(grads)
        first = stop.commit_now()
        if rank == 1:
            stop.requested.set()
        allreduce(grads)
        out.put((rank, [g.tolist() for g in grads], first, stop.commit_now()))
    finally:
        dist.destroy_process_group()


def test_two_ranks_average_their_gradients_and_agree_on_the_commit_in_the_same_all_reduce(tmp_path: Any) -> None:
    """A real gloo world of two: the gradients are the mean (the flag does not leak into them),
    and both ranks learn of rank 1's request in the same step."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, str(tmp_path / "store"), out)) for r in (0, 1)]
    for p in procs:
        p.start()
    results = sorted(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for rank, grads, first, second in results:
        assert grads == [[[1.5, 1.5], [1.5, 1.5]], [15.0, 15.0, 15.0]], rank  # (1+2)/2 twice over
        assert first is False and second is True, rank


def test_a_commit_snapshots_before_the_ranks_agree_and_checkpoints_after() -> None:
    """`worker_runtime/commit.py`'s order: a peer dying in the agreement must not cost this node its
    snapshot of the commit (seen: the survivor of a SIGKILLed node resumed two steps back), and
    rank 0's checkpoint copy must not hold the peers at the agreement."""
    from types import SimpleNamespace

    from elasticyolo.worker_runtime.commit import CommitHooks

    calls: list[str] = []
    core = SimpleNamespace(spec=SimpleNamespace(commit_every=0), progress=SimpleNamespace(step=3))
    engine = SimpleNamespace(save=lambda: calls.append("save"), agree=lambda: calls.append("agree"),
                             check=lambda: calls.append("check"))
    hooks = CommitHooks(core, None, target_s=1.0,  # type: ignore[arg-type]
                        snapshots=SimpleNamespace(maybe_save=lambda c: calls.append("snapshot")),  # type: ignore[arg-type]
                        checkpointer=SimpleNamespace(after_commit=lambda c: calls.append("checkpoint")),  # type: ignore[arg-type]
                        engine=engine)  # type: ignore[arg-type]
    hooks.commit()
    assert calls == ["save", "snapshot", "agree", "checkpoint", "check"]
