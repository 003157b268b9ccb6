"""The node-local snapshot module every engine uses (`train/snapshots.py`): the file format, the
background writer, and the newest-in-world restore stepped over an in-memory world of threads
(collectives passed in, as the engines pass Horovod's or torch.distributed's)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from elasticyolo.local_cluster.wait import in_threads  # noqa: E402
from elasticyolo.train.snapshots import LocalSnapshots, read_snapshot, restore_newest, write_snapshot  # noqa: E402
from elasticyolo.train.state import STATE_FORMAT, core_state  # noqa: E402


class _Ema:
    def __init__(self, model: Any) -> None:
        self.ema, self.updates = model, 0


class _Scaler:
    def is_enabled(self) -> bool:
        return False


class FakeCore:
    """What `core_state` / `load_core_state` touch, on a tiny model (no YOLO needed)."""

    def __init__(self, seed: int = 0, step: int = 0) -> None:
        from elasticyolo.train.core import Progress

        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 2)
        self.ema = _Ema(torch.nn.Linear(4, 2))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.scaler = _Scaler()
        self.progress = Progress(step=step, epoch=step // 10, consumed=step % 10, world=1)
        self.synced = 0

    def sync_sampler_from_progress(self) -> None:
        self.synced += 1


class World:
    """N ranks in threads; every collective is an all-gather over a barrier."""

    def __init__(self, n: int) -> None:
        self.n, self.barrier, self.slots = n, threading.Barrier(n, timeout=30), [None] * n

    def rank(self, r: int) -> "RankCollectives":
        return RankCollectives(self, r)


class RankCollectives:
    def __init__(self, world: World, rank: int) -> None:
        self.world, self.rank, self.size = world, rank, world.n

    def allgather_object(self, obj: Any) -> list[Any]:
        self.world.slots[self.rank] = obj
        self.world.barrier.wait()
        out = list(self.world.slots)
        self.world.barrier.wait()
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return self.allgather_object(obj)[src]

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        return bytes(self.allgather_object(data)[src])


def run_world(cores: list[FakeCore], snaps: list[LocalSnapshots | None], checkpointers: list[Any] | None = None
              ) -> list[Any]:
    world = World(len(cores))

    def rank(r: int) -> Any:
        ck = checkpointers[r] if checkpointers else None
        return restore_newest(cores[r], snaps[r], world.rank(r), ck)  # type: ignore[arg-type]

    out = in_threads(rank, len(cores), 60)
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out


def weights(core: FakeCore) -> torch.Tensor:
    return core.model.weight.detach().clone()


# ---- format and writer ----------------------------------------------------------------------------
def test_format_round_trip_torn_and_foreign_files(tmp_path: Path) -> None:
    state = core_state(FakeCore(step=7))
    write_snapshot(state, tmp_path / "s" / "state.pt")
    got = read_snapshot(tmp_path / "s" / "state.pt")
    assert got is not None and got["format"] == STATE_FORMAT and got["progress"]["step"] == 7
    assert not list((tmp_path / "s").glob(".*tmp"))  # the temp file was renamed away
    (tmp_path / "torn.pt").write_bytes(b"\x80\x02garbage")
    torch.save({"format": 999}, tmp_path / "foreign.pt")
    assert read_snapshot(tmp_path / "torn.pt") is None and read_snapshot(tmp_path / "foreign.pt") is None
    assert read_snapshot(tmp_path / "missing.pt") is None


def test_writer_period_save_now_and_readers(tmp_path: Path) -> None:
    core = FakeCore(step=3)
    writer = LocalSnapshots(tmp_path, writer=True, period_s=3600)
    reader = LocalSnapshots(tmp_path, writer=False)
    assert writer.maybe_save(core) is True  # the first commit always snapshots
    assert writer.flush(30) and writer.written_step == 3
    core.progress.step = 4
    assert writer.maybe_save(core) is False  # within the period
    assert writer.save_now(core, timeout=30) and reader.read()["progress"]["step"] == 4  # type: ignore[index]
    assert reader.maybe_save(core) is False and reader.save_now(core) is True  # a reader never writes
    writer.close()
    assert LocalSnapshots(None).read() is None


# ---- newest in the world -------------------------------------------------------------------------
def test_fresh_world_without_any_state(tmp_path: Path) -> None:
    cores = [FakeCore(seed=r) for r in range(2)]
    got = run_world(cores, [LocalSnapshots(tmp_path / str(r)) for r in range(2)])
    assert [(g.source, g.step) for g in got] == [("fresh", 0), ("fresh", 0)]


def test_a_new_node_gets_the_newest_snapshot_from_its_holder(tmp_path: Path) -> None:
    old, new = FakeCore(seed=1, step=5), FakeCore(seed=2, step=9)
    LocalSnapshots(tmp_path / "n0").save_now(old)  # rank 0's node: an older snapshot
    LocalSnapshots(tmp_path / "n1").save_now(new)  # rank 1's node: the newest
    cores = [FakeCore(seed=10), FakeCore(seed=11), FakeCore(seed=12)]  # rank 2: a new node, nothing
    snaps = [LocalSnapshots(tmp_path / d) for d in ("n0", "n1", "n2")]
    got = run_world(cores, snaps)
    assert [(g.source, g.step, g.src_rank) for g in got] == [("peer", 9, 1), ("local", 9, 1), ("peer", 9, 1)]
    for c in cores:
        assert torch.equal(weights(c), weights(new)) and c.progress.step == 9 and c.synced == 1


def test_store_ahead_of_every_node_is_loaded_by_rank_0_and_sent(tmp_path: Path) -> None:
    stored = core_state(FakeCore(seed=3, step=20))

    class Store:
        enabled = True

        def __init__(self) -> None:
            self.restored = 0

        def latest_step(self) -> int:
            return 20

        def restore_into(self, core: FakeCore) -> bool:
            from elasticyolo.train.state import load_core_state

            self.restored += 1
            load_core_state(core, stored)  # type: ignore[arg-type]
            return True

    LocalSnapshots(tmp_path / "n1").save_now(FakeCore(seed=4, step=12))
    cores, store = [FakeCore(seed=5), FakeCore(seed=6)], Store()
    got = run_world(cores, [LocalSnapshots(tmp_path / "n0"), LocalSnapshots(tmp_path / "n1")], [store, None])
    assert [(g.source, g.step) for g in got] == [("store", 20), ("store", 20)] and store.restored == 1
    assert all(c.progress.step == 20 and torch.equal(c.model.weight, cores[0].model.weight) for c in cores)


def test_sigterm_waits_for_the_snapshot_being_written_then_exits(tmp_path: Path) -> None:
    """torch elastic stops a worker with SIGTERM for its next round: the snapshot in flight lands
    first (the restarted world resumes from the newest commit), even with the main thread blocked."""
    import signal
    import subprocess
    import sys

    marker = tmp_path / "landed"
    child = f"""
import threading, time
from pathlib import Path
from elasticyolo.train.snapshots import finish_snapshot_on_sigterm

class SlowWrite:  # a snapshot still being written when the signal comes
    def flush(self, timeout=None):
        time.sleep(0.5)  # the write lasts past the signal: SIGTERM must wait for it
        Path({str(marker)!r}).write_text("ok")
        return True

assert finish_snapshot_on_sigterm(SlowWrite())
print("ready", flush=True)
threading.Event().wait()  # the main thread blocked (as in a collective)
"""
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 128 + signal.SIGTERM
        assert marker.read_text() == "ok"
    finally:
        proc.kill()


def test_a_flush_waits_for_the_commit_whose_state_is_being_copied(tmp_path: Path, monkeypatch) -> None:
    """A SIGTERM that lands while a commit copies its state (before the snapshot is submitted)
    still gets that commit's snapshot written: the flush the SIGTERM handler makes waits for it."""
    import elasticyolo.train.snapshots as snapshots_mod

    copying, release = threading.Event(), threading.Event()

    def slow_core_state(core: Any) -> dict[str, Any]:
        copying.set()
        release.wait(10)
        return core_state(core)

    monkeypatch.setattr(snapshots_mod, "core_state", slow_core_state)
    snaps = LocalSnapshots(tmp_path)
    committing = threading.Thread(target=snaps.maybe_save, args=(FakeCore(step=7),))
    committing.start()
    assert copying.wait(10)
    assert not snaps.flush(timeout=0.2)  # the commit is still copying: not flushed yet
    release.set()
    assert snaps.flush(timeout=10)
    committing.join(10)
    found = read_snapshot(snaps.path)
    assert found is not None and found["progress"]["step"] == 7
    snaps.close()


def test_ranks_at_the_same_commit_differ_only_in_their_rank_local_progress() -> None:
    # The Horovod reset's sync skips the tensor broadcast when every rank holds the same commit:
    # each rank's own seconds and train-loss history must not make them look different.
    from dataclasses import asdict

    from elasticyolo.train.core import Progress, shared_progress

    rank0 = asdict(Progress(epoch=2, consumed=8, step=5, world=3, seconds=1.0, history=[{"train/box_loss": 1.0}]))
    rank1 = {**rank0, "seconds": 2.5, "history": [{"train/box_loss": 1.3}]}
    assert shared_progress(rank0) == shared_progress(rank1)
    assert shared_progress(rank0) != shared_progress({**rank0, "consumed": 12})  # a commit behind
    assert shared_progress(rank0) != shared_progress({**rank0, "lr_scale": 2.0})
