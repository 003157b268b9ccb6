"""The elastic data loader (`elasticyolo.train.loader`): batches come from persistent worker
processes along the sampler's plan; a reset, rollback or resize discards what was prefetched
without waiting for it, and no sample is trained twice or skipped."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("torch")

from elasticyolo.local_cluster.wait import wait_for  # noqa: E402
from support.loader_data import IndexDataset, built  # noqa: E402
from elasticyolo.train.loader import BatchLoader, LoaderError, Request  # noqa: E402
from elasticyolo.train.loader_worker import CLOSED_MOSAIC  # noqa: E402
from elasticyolo.train.sampler import ElasticSampler  # noqa: E402


def linear_plan(name: str, start: int, size: int, count: int, variant: str = "") -> Iterator[Request]:
    for i in range(start, count):
        yield Request((name, i), "d", tuple(range(i * size, (i + 1) * size)), variant)


def make(tmp_path: Path, workers: int = 2, seconds: float = 0.0, n: int = 1000, **kw: object) -> BatchLoader:
    ds = IndexDataset(n, seconds=seconds, log=tmp_path / "built.log")
    loader = BatchLoader({"d": ds}, hyp=None, workers=workers, **kw)  # type: ignore[arg-type]
    assert loader.wait_ready(120), "loader workers did not start"
    return loader


def test_batches_come_from_worker_processes_in_plan_order(tmp_path: Path) -> None:
    loader = make(tmp_path)
    try:
        pids = set()
        for i in range(10):
            batch = loader.get("d", ("A", i), lambda: linear_plan("A", 0, 3, 10))
            assert batch is not None and batch["index"] == [3 * i, 3 * i + 1, 3 * i + 2] == batch["indices"]
            pids.add(batch["pid"])
        assert os.getpid() not in pids and loader.stats.inline == 0 and loader.stats.replans == 1
    finally:
        loader.close()


def test_replan_discards_prefetched_batches_without_waiting_for_them(tmp_path: Path) -> None:
    """Deep prefetch of slow samples, then the consumer jumps elsewhere (a rollback): the new
    batch arrives after about one sample's build time, not after the queued stale work; stale
    requests are skipped unbuilt and their results never handed out."""
    loader = make(tmp_path, workers=2, seconds=0.5, prefetch=8)  # 16 requests in flight
    try:
        first = loader.get("d", ("A", 0), lambda: linear_plan("A", 0, 1, 100))
        assert first is not None and first["index"] == [0]
        t0 = time.perf_counter()
        batch = loader.get("d", ("B", 50), lambda: linear_plan("B", 50, 1, 100))
        waited = time.perf_counter() - t0
        assert batch is not None and batch["index"] == [50]
        # Waiting for the 16 queued stale samples would take 16 x 0.5 s / 2 workers = 4 s.
        assert waited < 2.5, waited
        assert loader.stats.discarded == 16 and loader.stats.replans == 2
        for i in range(51, 60):
            b = loader.get("d", ("B", i), lambda: linear_plan("B", i, 1, 100))
            assert b is not None and b["index"] == [i]
        stale_built = {i for _, i in built(tmp_path / "built.log") if 0 < i < 50}
        assert len(stale_built) <= 4, stale_built  # at most what was already being built
    finally:
        loader.close()


def test_rollback_and_resize_keep_each_epoch_exactly_once(tmp_path: Path) -> None:
    """Three ranks train with prefetching loaders; a failure rolls the survivors back to the
    last commit and the world shrinks to 2: the batches handed out after the rollback, with the
    committed ones before it, cover the epoch exactly once, and every loader discarded its
    prefetched, now wrong, batches."""
    n, batch = 60, 2
    ds = IndexDataset(n)
    loaders = [BatchLoader({"train": ds}, hyp=None, workers=1, prefetch=3) for _ in range(3)]
    samplers = [ElasticSampler(n, batch, seed=7) for _ in range(3)]
    try:
        for ld in loaders:
            assert ld.wait_ready(120)

        def plan(s: ElasticSampler, rank: int, world: int) -> Iterator[Request]:
            for sh in s.plan(rank, world, s.state.epoch, s.state.consumed, 1):
                yield Request((sh.epoch, sh.start, world, rank), "train", tuple(sh.indices))

        def micro_step(world: int) -> list[int]:
            got = []
            for rank in range(world):
                s = samplers[rank]
                key = (s.state.epoch, s.state.consumed, world, rank)
                b = loaders[rank].get("train", key, lambda s=s, rank=rank: plan(s, rank, world))
                expected = s.shard(rank, world)
                assert (b["indices"] if b else []) == expected
                got.extend(expected)
            for s in samplers[:world]:
                s.advance(world)
            return got

        trained = []
        for _ in range(3):
            trained += micro_step(3)
        commit = samplers[0].state_dict()
        for _ in range(2):
            micro_step(3)  # lost with the dead rank: not committed
        for s in samplers[:2]:
            s.load_state_dict(commit)  # the survivors roll back to the commit
        while not samplers[0].epoch_done():
            trained += micro_step(2)
        assert sorted(trained) == list(range(n))
        assert all(ld.stats.discarded > 0 for ld in loaders[:2]), [ld.stats for ld in loaders]
    finally:
        for ld in loaders:
            ld.close()


def test_variant_travels_with_each_request(tmp_path: Path) -> None:
    loader = make(tmp_path, workers=1)
    try:
        def plan(start: int) -> Iterator[Request]:
            for i in range(start, 6):
                yield Request(("E", i), "d", (i,), CLOSED_MOSAIC if i >= 3 else "")

        kinds = [loader.get("d", ("E", i), lambda i=i: plan(i))["transforms"][0]  # type: ignore[index]
                 for i in range(6)]
        assert kinds == ["open"] * 3 + ["closed"] * 3
        # A rollback from the closed epoch to before it gets the open transforms again.
        assert loader.get("d", ("E", 1), lambda: plan(1))["transforms"] == ["open"]  # type: ignore[index]
    finally:
        loader.close()


def test_worker_error_is_raised_with_its_traceback(tmp_path: Path) -> None:
    loader = make(tmp_path, workers=1, n=10)
    try:
        with pytest.raises(LoaderError, match="IndexError: sample 12 out of range"):
            loader.get("d", ("A", 4), lambda: linear_plan("A", 4, 3, 10))
    finally:
        loader.close()


def test_a_killed_worker_is_replaced_and_its_work_resubmitted(tmp_path: Path) -> None:
    loader = make(tmp_path, workers=2, seconds=0.2)
    try:
        b = loader.get("d", ("A", 0), lambda: linear_plan("A", 0, 1, 100))
        assert b is not None
        os.kill(b["pid"], signal.SIGKILL)
        got = [loader.get("d", ("A", i), lambda: linear_plan("A", 0, 1, 100))["index"][0]  # type: ignore[index]
               for i in range(1, 12)]
        assert got == list(range(1, 12)) and loader.stats.pool_restarts == 1
    finally:
        loader.close()


def test_workers_exit_with_the_training_process(tmp_path: Path) -> None:
    """SIGKILL of the process that owns a loader leaves no loader process behind."""
    import subprocess
    import sys

    import psutil

    code = ("import sys, time\n"
            f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})  # tests/, for support.loader_data\n"
            "from support.loader_data import IndexDataset\n"
            "from elasticyolo.train.loader import BatchLoader\n"
            "if __name__ == '__main__':\n"
            "    ld = BatchLoader({'d': IndexDataset(10)}, None, workers=2)\n"
            "    assert ld.wait_ready(120)\n"
            "    print('ready', flush=True)\n"
            "    time.sleep(600)\n")
    script = tmp_path / "owner.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        helpers = psutil.Process(proc.pid).children(recursive=True)
        assert len(helpers) >= 4  # resource tracker, fork server, loader host, 2 workers
        proc.kill()
        proc.wait(10)
        wait_for(lambda: not any(h.is_running() and h.status() != psutil.STATUS_ZOMBIE for h in helpers), 15,
                   "loader processes to exit after their owner was killed")
    finally:
        proc.kill()
