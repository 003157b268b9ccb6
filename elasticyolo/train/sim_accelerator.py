"""A simulated node's accelerator, for clusters simulated on CPUs (local_cluster/cpu_slices.py).

On a GPU node, training steps run on the GPU while the agent, the zygote, a warm standby's
imports, the data loader and the checkpoint uploader use the host's cores beside it: none of
them slows a step. A replay on one CPU host stands for a node's GPU with a CPU quota of its own
(a cgroup), and for its host with a second cgroup outside that quota; the agent and everything
it starts run in the host one. When a worker starts training it moves itself into the
accelerator cgroup (`enter`), so only training counts against the quota.

Without it (2-core x86-64 VM, the whole node in one 0.44-CPU quota), rank 0's node gives 0.10 CPU
of it to its uploader and its (leader) agent, and since a synchronous world trains at its slowest
rank's pace, every other rank waits on it.

Only the training thread moves (cgroup v1 `tasks`) when it is where torch computes (one intra-op
thread, as the replay runs workers), and every other thread of the process goes to the host:
Horovod's background thread (it coordinates the ranks every millisecond), the process group's
communication threads and the snapshot writer run on a GPU node's host cores. With the whole process in the
quota, a Horovod world of 3 trained either at 0.79 s or at 1.35-1.40 s per step, set at each
world's start (calibrations and replays alike). Otherwise (cgroup v2, several intra-op
threads) the whole process moves.

Except the threads that carry the world's collectives (`INTERCONNECT_THREADS`): torch's gloo
process group's, and Horovod's background loop and its bundled gloo's transport, which name no
thread and are named `HOROVOD_THREAD` when `hvd.init()` starts them (`name_threads_started`).
They go to the cluster's simulated interconnect when there is one (`ELASTICYOLO_SIM_INTERCONNECT`),
since a GPU world's all-reduce is NCCL's and the network's, which no host work slows
(local_cluster/cpu_slices.py has the figures). Horovod's world of 4 still calibrates below 3 there
(54.7 against 65.6 samples/s; 56.6 against 68.9 on the host): its background loops burn
0.21 CPU per node wherever they run.

Unset (every real deployment) nothing happens.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

from elasticyolo.worker_runtime.worker_env import ENV_SIM_ACCELERATOR, ENV_SIM_INTERCONNECT
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.sim_accelerator")


# Horovod's threads, named so by `name_threads_started` around `hvd.init()` (at most 15 bytes).
HOROVOD_THREAD = "hvd_comm"
# torch's ProcessGroupGloo: its workers, which run every collective, and its TCP transport's loop;
# Horovod's background loop (it runs every collective) and its gloo transport.
INTERCONNECT_THREADS = frozenset({"pt_gloo_runloop", "gloo_tcp_loop", HOROVOD_THREAD})

_host_procs: list[str] = []  # this process's own cgroups before `enter`: the node's host side
_host_cpus: set[int] = set()  # and the CPUs it could run on then


def enter(helpers: bool) -> None:
    """Move this process onto the node's simulated accelerator (idempotent; again after threads
    were started: they go to the host). `helpers`: it will
    start helper processes (checkpoint uploader, loader workers) now; a fork server started later
    is moved to the host (`host_side`, which `mp.start_fork_server` calls from then on)."""
    paths = [p for p in os.environ.get(ENV_SIM_ACCELERATOR, "").split(os.pathsep) if p]
    if not paths:
        return
    from elasticyolo import mp

    if not _host_procs:
        _host_procs.extend(_own_groups(paths))
        _host_cpus.update(os.sched_getaffinity(0))
        mp.place_fork_server = host_side
    if helpers:
        # Helpers (the checkpoint uploader, loader workers) are forked from the fork server and
        # inherit its cgroup: start it while this process is still on the host side.
        mp.start_fork_server()
    thread_only = _computes_on_this_thread() and all(os.path.exists(_tasks(p)) for p in paths + _host_procs)
    for path in paths:
        target, who = (_tasks(path), threading.get_native_id()) if thread_only else (path, os.getpid())
        try:
            with open(target, "w") as f:
                f.write(str(who))
        except OSError as exc:  # the simulation's slice is gone: train on, measured wrongly, said
            log.warning("sim_accelerator_enter_failed", path=target, error=str(exc))
    if thread_only:
        # Every other thread to the host: those started before (the first time) and those the
        # training thread started since, inheriting its cgroup (Horovod's new background thread
        # after each reset, the snapshot writer); the process group's to the interconnect.
        me = threading.get_native_id()
        interconnect = os.environ.get(ENV_SIM_INTERCONNECT, "")
        for tid in (int(t) for t in os.listdir("/proc/self/task") if int(t) != me):
            try:
                for path in _host_procs:  # the unpinned cpuset too, for an interconnect thread
                    with open(_tasks(path), "w") as f:
                        f.write(str(tid))
                if interconnect and _thread_name(tid) in INTERCONNECT_THREADS:
                    with open(_tasks(interconnect), "w") as f:
                        f.write(str(tid))
                os.sched_setaffinity(tid, _host_cpus)  # one started on the pinned core keeps it otherwise
            except OSError:  # the thread ended meanwhile
                continue


@contextmanager
def name_threads_started(name: str) -> Iterator[None]:
    """Name the threads this process starts inside the block (a library that names none of its
    own, such as Horovod's `hvd.init()`), so that `enter` and `top -H` can tell them apart."""
    before = set(os.listdir("/proc/self/task"))
    yield
    for tid in set(os.listdir("/proc/self/task")) - before:
        try:
            with open(f"/proc/self/task/{tid}/comm", "w") as f:
                f.write(name)
        except OSError:  # the thread ended meanwhile
            continue


def _thread_name(tid: int) -> str:
    with open(f"/proc/self/task/{tid}/comm") as f:
        return f.read().strip()


def _tasks(procs: str) -> str:
    """A cgroup v1 group's per-thread membership file beside its `cgroup.procs`."""
    return os.path.join(os.path.dirname(procs), "tasks")


def _computes_on_this_thread() -> bool:
    """Whether all of this process's training compute runs on the calling thread: torch not
    loaded, or computing on one intra-op thread, and this is the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return False
    torch = sys.modules.get("torch")
    return torch is None or int(torch.get_num_threads()) == 1


def host_side(pid: int) -> None:
    """Move a helper server this process started after `enter` (a rank that became rank 0 and
    now checkpoints) to the node's host, where a GPU node runs it: its imports and its helpers'
    work never count against the accelerator's quota. Nothing happens unless simulated."""
    try:
        for path in _host_procs:
            with open(path, "w") as f:
                f.write(str(pid))
        if _host_cpus:
            # Leaving the pinned cpuset does not widen the affinity here (seen on 6.18, cgroup v1:
            # a child forked on the pinned core kept it in the root cpuset): set it as well.
            os.sched_setaffinity(pid, _host_cpus)
    except OSError as exc:
        log.warning("sim_accelerator_host_side_failed", pid=pid, error=str(exc))


def _own_groups(accelerator_procs: list[str]) -> list[str]:
    """For each accelerator `cgroup.procs` file, this process's current cgroup in that hierarchy
    (its `cgroup.procs` file): cgroup v1 keeps one hierarchy per controller (cpu, cpuset), v2 one."""
    mounts: list[tuple[str, set[str]]] = []  # (mount point, controllers; empty for v2)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fstype, _, options = right.split()[:3]
            if fstype in ("cgroup", "cgroup2"):
                mounts.append((left.split()[4], set(options.split(",")) if fstype == "cgroup" else set()))
    member: dict[frozenset[str], str] = {}  # controllers -> this process's path in that hierarchy
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            member[frozenset(c for c in controllers.split(",") if c)] = path
    found = []
    for procs in accelerator_procs:
        mount = max((m for m in mounts if procs.startswith(m[0] + "/")), key=lambda m: len(m[0]), default=None)
        if mount is None:
            continue
        path = next((p for c, p in member.items() if (c & mount[1]) or (not c and not mount[1])), None)
        if path is not None:
            found.append(os.path.join(mount[0], path.lstrip("/"), "cgroup.procs"))
    return found
