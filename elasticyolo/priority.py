"""CPU priorities: the node agent above its workers, so a busy node cannot starve what keeps it in
the cluster (its lease keep-alive, heartbeats, the leader's driver).

The agent raises itself to `AGENT_NICE` first thing (`as_agent`, before its threads start), so every
launcher gets it: the systemd unit (which also says `Nice=-5`), the demo, the chaos replay and the
tests. Every process the agent starts drops back to `WORKER_NICE` first thing
(`worker_runtime/lifeline.py`), so training runs at normal priority and only the agent's light work is
ahead of it. The embedded etcd of the demo, the replay and the tests runs at `ETCD_NICE`, as
deploy/etcd's unit does (`Nice=-5`): a starved etcd lets every lease lapse at once. Without these,
two CPU hogs beside a 2-node job on 2 cores made both agents' 2 s leases lapse at once. The Ray
engine's nodes are Ray's daemons (raylet, GCS, Ray's agents): they run at the agent's priority too
(`as_node_daemon`, or `nice -n -5 ray start`), and its training actors drop back (`as_worker`
moves every thread of the process: Ray's worker has started threads of its own by then). Lowering a
nice value needs CAP_SYS_NICE: without it (an unprivileged run) a process keeps the priority it was
started with.

Sessions. Where the kernel shares CPU time among sessions first (autogroup,
`kernel.sched_autogroup_enabled=1`, the default of Debian's kernels), a nice value orders a process
only against the processes of its own session, and every session weighs the same as one nice-0
process: the agent at nice -5 in one session and each worker in a session of its own (spawn.py
starts them so, to signal their process groups) would weigh the same. So a process that leads its
own session sets its session's nice too (`/proc/self/autogroup`): the agent under systemd or
started by the local cluster, and etcd started by `priority_prefix`. A process in a cgroup with
its own CPU controller (a container, a systemd slice) is in no autogroup: the file reads empty, and
the cgroup's weight orders it instead. No torch here.
"""

from __future__ import annotations

import os
import sys
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


def session_nice() -> int | None:
    """This process's session's nice (autogroup); None where it is in no autogroup."""
    try:
        fields = SESSION_NICE_FILE.read_text().split()  # "/autogroup-N nice K", or empty
    except OSError:
        return None
    return int(fields[-1]) if fields else None


def set_session_nice(nice: int) -> bool:
    """Where this process leads its session, set the session's nice. False if it does not lead one,
    it is in no autogroup, or it is not permitted."""
    if os.getsid(0) != os.getpid() or session_nice() is None:
        return False
    try:
        SESSION_NICE_FILE.write_text(str(nice))
        return True
    except OSError:
        return False


def threads_of(pid: int) -> list[int]:
    """The thread ids of a running process ([] once it is gone)."""
    try:
        return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def move_process_nice(pid: int, nice: int, *, up: bool) -> bool:
    """Every thread of a running process to `nice`, only where that moves it up (`up`: to a
    lower nice value) or only down (a nice value is per thread on Linux; a thread starts at its
    creator's). Twice over the threads, for those started during the first pass. False if a
    thread could not be moved (not permitted)."""
    moved = True
    for _ in range(2):
        for tid in threads_of(pid):
            try:
                current = os.getpriority(os.PRIO_PROCESS, tid)
                if (current > nice) if up else (current < nice):
                    os.setpriority(os.PRIO_PROCESS, tid, nice)
            except ProcessLookupError:
                continue
            except PermissionError:
                moved = False
    return moved


def as_worker() -> None:
    """In a process an agent (or a Ray node's daemons, `as_node_daemon`) started: every thread
    back to normal priority, before training starts its threads."""
    move_process_nice(os.getpid(), WORKER_NICE, up=False)


def as_node_daemon(pid: int) -> bool:
    """A running node daemon that is not ours (a Ray raylet, GCS or Ray's agents of a node) up to
    the agent's priority, never down: it keeps the node in its cluster as our agent does. The
    processes it starts later inherit it: a training process calls `as_worker`. False if not
    permitted."""
    return move_process_nice(pid, AGENT_NICE, up=True)


def as_agent() -> bool:
    """In the agent, before any thread starts: up to `AGENT_NICE` (never down). False if not permitted."""
    current_session_nice = session_nice()
    if current_session_nice is not None and current_session_nice > AGENT_NICE:
        set_session_nice(AGENT_NICE)
    if os.getpriority(os.PRIO_PROCESS, 0) > AGENT_NICE:
        return set_nice(AGENT_NICE)
    return True


def priority_prefix(nice: int) -> list[str]:
    """A command prefix that starts a program (every thread of it) at `nice`, and its session too
    when the program leads its session (`start_new_session=True`); the program goes on at the
    current priority where that is not permitted."""
    return [sys.executable, "-m", "elasticyolo.priority", str(nice)]


def _exec_at(argv: list[str]) -> None:
    """`python -m elasticyolo.priority NICE PROGRAM [ARG...]`: the body of `priority_prefix`."""
    nice, program = int(argv[0]), argv[1:]
    set_session_nice(nice)
    set_nice(nice)
    os.execvp(program[0], program)


if __name__ == "__main__":
    _exec_at(sys.argv[1:])
