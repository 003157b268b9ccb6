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


def set_nice(nice: int, pid: int = 0) -> bool:
    """Set the nice value of process `pid`, every thread it has now (threads inherit it from the
    thread that starts them), or of this thread (0). False if not permitted."""
    tids = [pid]
    if pid:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            pass
    try:
        for tid in tids:
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        return True
    except (PermissionError, ProcessLookupError):
        return False


def as_worker() -> None:
    """In a process an agent started: back to normal priority, before any thread starts."""
    if os.getpriority(os.PRIO_PROCESS, 0) < WORKER_NICE:
        set_nice(WORKER_NICE)
