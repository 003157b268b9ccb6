"""torchrun script that steps until told to stop: every step is one gloo all_reduce.

Appends one JSON line per step to $EY_LOG (time, step, world size, rank, pid, restart count).
All ranks stop together when the file $EY_STOP exists (the stop flag is all-reduced).
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from elasticyolo.worker_runtime.lifeline import die_with_parent  # torchrun's agent does not kill its workers


def main() -> None:
    if os.environ.get("EY_PDEATHSIG", "1") == "1":
        die_with_parent()
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    log, stop = os.environ["EY_LOG"], os.environ["EY_STOP"]
    step = 0
    while True:
        flags = torch.tensor([1.0, 1.0 if os.path.exists(stop) else 0.0])
        dist.all_reduce(flags)
        assert int(flags[0].item()) == world, (flags, world)
        with open(log, "a") as f:
            f.write(json.dumps({"t": time.time(), "step": step, "world": world, "rank": rank,
                                "pid": os.getpid(), "node": os.environ.get("EY_NODE"),
                                "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))}) + "\n")
        if flags[1].item() > 0:
            break
        step += 1
        time.sleep(0.1)  # the step's pace: a few steps a second to watch
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
