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
started with.

Sessions. Where the kernel shares CPU time among sessions first (autogroup,
`kernel.sched_autogroup_enabled=1`, the default of Debian's kernels), a nice value orders a process
only against the processes of its own session, and every session weighs the same as one nice-0
process: the agent at nice -5 in one session and each worker in a session of its own (spawn.py
starts them so, to signal their process groups) would weigh the same. So a process that leads its
own session sets its session's nice too (`/proc/self/autogroup`): the agent under systemd or
started by the local cluster, and etcd started by `priority_prefix`. No torch here.
"""

from __future__ import annotations

import os
from pathlib import Path

AGENT_NICE = -5  # systemd/elasticyolo-agent.service: Nice=
ETCD_NICE = -5  # deploy/etcd/etcd-member.service: Nice=
WORKER_NICE = 0
SESSION_NICE_FILE = Path("/proc/self/autogroup")  # "/autogroup-N nice K" where the kernel has autogroup


def set_nice(nice: int) -> bool:
    """Set this thread's nice value (threads it starts later inherit it). False if not permitted."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
        return True
    except PermissionError:
        return False


def set_session_nice(nice: int) -> bool:
    """Where this process leads its session, set the session's nice (autogroup). False if it does
    not lead one, the kernel has no autogroup, or it is not permitted."""
    if os.getsid(0) != os.getpid():
        return False
    try:
        SESSION_NICE_FILE.write_text(str(nice))
        return True
    except OSError:
        return False


def as_worker() -> None:
    """In a process an agent started: back to normal priority, before any thread starts."""
    if os.getpriority(os.PRIO_PROCESS, 0) < WORKER_NICE:
        set_nice(WORKER_NICE)


def as_agent() -> bool:
    """In the agent, before any thread starts: up to `AGENT_NICE` (never down). False if not permitted."""
    set_session_nice(AGENT_NICE)
    if os.getpriority(os.PRIO_PROCESS, 0) > AGENT_NICE:
        return set_nice(AGENT_NICE)
    return True


def priority_prefix(nice: int) -> list[str]:
    """A command prefix that starts a program (every thread of it) at `nice`, and its session too
    when it is started in a session of its own (`start_new_session=True`); the program goes on at the
    current priority where lowering is not permitted."""
    return ["sh", "-c", f'echo {nice} > {SESSION_NICE_FILE} 2>/dev/null; exec nice -n {nice} "$@"', "sh"]
