"""CPU priorities: the node agent above its workers, so a busy node cannot starve what keeps it in
the cluster (its lease keep-alive, heartbeats, the leader's driver).

The agent raises itself to `AGENT_NICE` first thing (`as_agent`, before its threads start), so every
launcher gets it: the systemd unit (which also says `Nice=-5`), the demo, the chaos replay and the
tests. Every process the agent starts drops back to `WORKER_NICE` first thing
(`worker_runtime/lifeline.py`), so training runs at normal priority and only the agent's light work is
ahead of it. The embedded etcd of the demo, the replay and the tests runs at `ETCD_NICE`, as
deploy/etcd's unit does (`Nice=-5`): a starved etcd lets every lease lapse at once. Without these,
two CPU hogs beside a 2-node job on 2 cores made both agents' 2 s leases lapse at once. Lowering a
nice value needs CAP_SYS_NICE: without it (an unprivileged run) a process keeps the priority it was
started with. No torch here.
"""

from __future__ import annotations

import os

AGENT_NICE = -5  # systemd/elasticyolo-agent.service: Nice=
ETCD_NICE = -5  # deploy/etcd/etcd-member.service: Nice=
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


def as_agent() -> bool:
    """In the agent, before any thread starts: up to `AGENT_NICE` (never down). False if not permitted."""
    if os.getpriority(os.PRIO_PROCESS, 0) > AGENT_NICE:
        return set_nice(AGENT_NICE)
    return True


def nice_prefix(nice: int) -> list[str]:
    """A command prefix that starts a program (every thread of it) at `nice`; `nice` itself goes on
    at the current priority when lowering is not permitted."""
    return ["nice", "-n", str(nice)]
