"""Horovod's part of a reset's state transfer (`train/state_shares.py`): its alltoall."""

from __future__ import annotations

import horovod.torch as hvd
import torch

from elasticyolo.train.state_shares import send_shards as _send_shards


def hvd_alltoall(payload: torch.Tensor, splits: list[int], incoming: list[int], index: int) -> torch.Tensor:
    """Horovod's alltoall exchanges the split sizes itself: `incoming` is not needed."""
    received, _ = hvd.alltoall(payload, splits=torch.tensor(splits, dtype=torch.int32), name=f"sync.shards.{index}")
    return received  # type: ignore[no-any-return]


def send_shards(tensors: list[torch.Tensor], senders: list[int], receivers: list[int]) -> None:
    """`state_shares.send_shards` over Horovod (every rank calls it, in the same order)."""
    _send_shards(tensors, senders, receivers, rank=hvd.rank(), size=hvd.size(), alltoall=hvd_alltoall)
