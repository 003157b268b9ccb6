"""Elastic sampling: every index of an epoch is trained exactly once, whatever the world does.

An epoch is a fixed permutation of the dataset (seed + epoch). Training consumes it as a prefix:
the state is just `(epoch, consumed)`. Each global step takes the next `world * batch` positions
and splits them into `world` contiguous shards (sizes differ by at most one), so:
- rolling back to a commit restores `consumed`, and the positions after it are trained again
  exactly once;
- re-sharding to a new world size only changes how the remaining suffix is split.
A shard can be empty on the very last step of an epoch when fewer samples than ranks remain;
that rank contributes zero gradients to that step (see `TrainCore._optimizer_step`).

Pure Python (no torch) so the invariants are unit-testable.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Iterator, NamedTuple


class Shard(NamedTuple):
    """One rank's part of one global micro-step: where it starts in the epoch and what it trains."""

    epoch: int
    start: int  # position in the epoch's permutation where the global micro-step starts
    indices: list[int]


@dataclass
class SamplerState:
    epoch: int = 0
    consumed: int = 0  # positions of this epoch's permutation already trained (committed or not)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class ElasticSampler:
    def __init__(self, num_samples: int, batch: int, seed: int = 0, shuffle: bool = True) -> None:
        if num_samples < 1:
            raise ValueError("dataset is empty")
        self.num_samples = num_samples
        self.batch = batch
        self.seed = seed
        self.shuffle = shuffle
        self.state = SamplerState()
        self._perms: dict[int, list[int]] = {}  # the few epochs in use (current, and the next one prefetched)

    # ---- the epoch permutation -----------------------------------------------------------
    def permutation(self, epoch: int) -> list[int]:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = list(range(self.num_samples))
            if self.shuffle:
                random.Random(self.seed * 100_003 + epoch).shuffle(perm)
            if len(self._perms) >= 3:
                del self._perms[next(iter(self._perms))]  # the oldest one computed
            self._perms[epoch] = perm
        return perm

    # ---- stepping ------------------------------------------------------------------------
    def remaining(self) -> int:
        return self.num_samples - self.state.consumed

    def steps_left(self, world: int) -> int:
        per_step = world * self.batch
        return -(-self.remaining() // per_step)

    def step_span(self, world: int) -> int:
        """How many positions the next global step consumes."""
        return min(world * self.batch, self.remaining())

    def shard(self, rank: int, world: int, start: int | None = None, epoch: int | None = None) -> list[int]:
        """Dataset indices rank `rank` trains in the global step starting at position `start`
        (default: the current `consumed`) of `epoch` (default: the current one).

        Ranks take whole micro-batches in rank order, also in an epoch's last, partial step
        (where the last ranks get fewer samples or none): every sample is then in the same
        micro-batch at every world size, so BatchNorm normalizes the same groups and a run at any
        world size, or through resizes, computes the gradients of a run at world 1 up to float
        summation order."""
        start = self.state.consumed if start is None else start
        epoch = self.state.epoch if epoch is None else epoch
        span = min(world * self.batch, self.num_samples - start)
        lo = start + min(rank * self.batch, span)
        hi = start + min((rank + 1) * self.batch, span)
        return self.permutation(epoch)[lo:hi]

    def advance(self, world: int) -> None:
        """Mark the current global step as trained."""
        self.state.consumed += self.step_span(world)

    def epoch_done(self) -> bool:
        return self.state.consumed >= self.num_samples

    def next_epoch(self) -> None:
        self.state = SamplerState(epoch=self.state.epoch + 1, consumed=0)

    def plan(self, rank: int, world: int, epoch: int, consumed: int, end_epoch: int) -> Iterator[Shard]:
        """What rank `rank` will train from (epoch, consumed) on if the world stays `world`: this
        epoch's remaining micro-steps, then whole epochs up to `end_epoch` (exclusive). A data
        loader prefetches along it; any change of position or world starts a new plan."""
        e, pos = epoch, consumed
        while e < end_epoch:
            while pos < self.num_samples:
                yield Shard(e, pos, self.shard(rank, world, pos, e))
                pos += min(world * self.batch, self.num_samples - pos)
            e, pos = e + 1, 0

    # ---- state ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return self.state.as_dict()

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = SamplerState(epoch=int(state["epoch"]), consumed=int(state["consumed"]))
