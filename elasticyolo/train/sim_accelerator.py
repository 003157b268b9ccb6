"""A simulated node's accelerator, for clusters simulated on CPUs (testing/cpu_slices.py).

On a GPU node, training steps run on the GPU while the agent, the zygote, a warm standby's
imports, the data loader and the checkpoint uploader use the host's cores beside it: none of
them slows a step. A replay on one CPU host stands for a node's GPU with a CPU quota of its own
(a cgroup), and for its host with a second cgroup outside that quota; the agent and everything
it starts run in the host one. When a worker starts training it moves itself into the
accelerator cgroup (`enter`), so only training counts against the quota.

Measured before this existed (stop 26, 2 cores, the whole node in one 0.44-CPU quota): rank 0's
node gave 0.10 CPU of it to its uploader and its (leader) agent, and since a synchronous world
trains at its slowest rank's pace, every other rank waited on it.

Unset (every real deployment) nothing happens.
"""

from __future__ import annotations

import os

from elasticyolo.engines.worker_env import ENV_SIM_ACCELERATOR
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.sim_accelerator")


def enter(helpers: bool) -> None:
    """Move this process onto the node's simulated accelerator (idempotent). `helpers`: it will
    start helper processes (checkpoint uploader, loader workers)."""
    paths = [p for p in os.environ.get(ENV_SIM_ACCELERATOR, "").split(os.pathsep) if p]
    if not paths:
        return
    if helpers:
        # Helpers (the checkpoint uploader, loader workers) are forked from the fork server and
        # inherit its cgroup: start it while this process is still on the host side.
        from elasticyolo.mp import start_fork_server

        start_fork_server()
    for path in paths:
        try:
            with open(path, "w") as f:
                f.write(str(os.getpid()))
        except OSError as exc:  # the simulation's slice is gone: train on, measured wrongly, said
            log.warning("sim_accelerator_enter_failed", path=path, error=str(exc))
