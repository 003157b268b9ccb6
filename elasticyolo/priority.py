"""CPU priorities: the node agent above its workers, so a busy node cannot starve what keeps it in
the cluster (its lease keep-alive, heartbeats, the leader's driver).

The systemd unit starts the agent at `AGENT_NICE` (`Nice=-5`, as deploy/etcd's unit does for etcd);
every process the agent starts drops back to `WORKER_NICE` first thing (`engines/lifeline.py`), so
training runs at normal priority and only the agent's light work is ahead of it (etcd's own unit
in deploy/etcd runs at Nice=-5 as well). Seen without it:
two CPU hogs beside a 2-node job on 2 cores, both agents' 2 s leases lapsed at once and the job
restarted. Lowering a nice value needs CAP_SYS_NICE: without it (an unprivileged test run) the
agent simply keeps the priority it was started with. No torch here.
"""

from __future__ import annotations

import os

AGENT_NICE = -5  # systemd/elasticyolo-agent.service: Nice=
WORKER_NICE = 0


def set_nice(nice: int) -> bool:
    """Set this thread's nice value (threads it starts later inherit it). False if not permitted."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        return True
    except PermissionError:
        return False


def as_worker() -> None:
    """In a process an agent started: back to normal priority, before any thread starts."""
    if os.getpriority(os.PRIO_PROCESS, 0) < WORKER_NICE:
        set_nice(WORKER_NICE)
