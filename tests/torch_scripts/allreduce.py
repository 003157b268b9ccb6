"""Tiny torchrun script: one gloo all_reduce, result written to $EY_OUT/rank<R>.json."""

from __future__ import annotations

import json
import os
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    with open(os.path.join(os.environ["EY_OUT"], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "sum": t.item(), "pid": os.getpid()}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
