"""The elastic sampler covers every index of an epoch exactly once across resizes and rollbacks."""

from __future__ import annotations

import random

import pytest

from elasticyolo.train.sampler import ElasticSampler


def run_schedule(n: int, batch: int, worlds: list[int], seed: int = 0) -> list[int]:
    """Train one epoch, changing the world size after each step as `worlds` says (the last size
    repeats). Returns every index trained, in order."""
    s = ElasticSampler(n, batch, seed=seed)
    seen: list[int] = []
    step = 0
    while not s.epoch_done():
        world = worlds[min(step, len(worlds) - 1)]
        for rank in range(world):
            seen.extend(s.shard(rank, world))
        s.advance(world)
        step += 1
    return seen


@pytest.mark.parametrize("n,batch", [(1, 1), (7, 2), (64, 8), (101, 4), (1000, 16)])
def test_reshard_3_to_2_to_4_covers_epoch_exactly_once(n: int, batch: int) -> None:
    seen = run_schedule(n, batch, [3, 3, 2, 2, 4])
    assert sorted(seen) == list(range(n))


def test_random_resize_schedules_property() -> None:
    rng = random.Random(1234)
    for _ in range(300):
        n, batch = rng.randint(1, 300), rng.randint(1, 16)
        worlds = [rng.randint(1, 8) for _ in range(rng.randint(1, 20))]
        seen = run_schedule(n, batch, worlds, seed=rng.randint(0, 99))
        assert sorted(seen) == list(range(n)), (n, batch, worlds)


def test_rollback_to_commit_retrains_suffix_once() -> None:
    """Train some steps at world 3, roll back to a commit, continue at world 2: counting only the
    work after the rollback point once, every index is covered exactly once."""
    n, batch = 90, 4
    s = ElasticSampler(n, batch, seed=3)
    committed_work: list[int] = []
    for _ in range(3):
        for r in range(3):
            committed_work.extend(s.shard(r, 3))
        s.advance(3)
    commit = s.state_dict()
    for _ in range(2):  # uncommitted work, lost with a dead worker
        s.advance(3)
    s.load_state_dict(commit)
    while not s.epoch_done():
        for r in range(2):
            committed_work.extend(s.shard(r, 2))
        s.advance(2)
    assert sorted(committed_work) == list(range(n))


def test_ranks_take_whole_micro_batches_in_order_and_the_last_step_may_leave_some_empty() -> None:
    s = ElasticSampler(10, 4, seed=0)
    s.state.consumed = 8  # 2 samples left for 3 ranks
    shards = [s.shard(r, 3) for r in range(3)]
    assert [len(x) for x in shards] == [2, 0, 0]
    assert s.steps_left(3) == 1


def test_every_sample_is_in_the_same_micro_batch_at_every_world_size() -> None:
    """What makes a resized run compute a world-1 run's gradients (BatchNorm normalizes per
    micro-batch): the groups of `batch` consecutive positions, the partial last one included."""
    n, batch = 43, 4

    def groups(world: int) -> set[tuple[int, ...]]:
        s, out = ElasticSampler(n, batch, seed=3), set()
        while not s.epoch_done():
            out |= {tuple(x) for r in range(world) if (x := s.shard(r, world))}
            s.advance(world)
        return out

    assert all(groups(w) == groups(1) for w in (2, 3, 4, 5, 12))


def test_epochs_use_different_permutations_deterministically() -> None:
    a, b = ElasticSampler(50, 5, seed=9), ElasticSampler(50, 5, seed=9)
    assert a.permutation(0) == b.permutation(0)
    assert a.permutation(0) != a.permutation(1)
