"""CPUs per simulated node: local agents that behave like separate GPU machines.

On one host, simulated nodes share its cores: a node's throughput then depends on what every
other process does, so more nodes need not train faster and a joiner's start-up slows the world
it joins (measured on 2 cores: 4 nodes calibrated at 33, 73 and 65 samples/s in one run). A GPU
node trains on its GPU and runs its agent, its warm standby's imports and its checkpoint uploads
on host cores beside it. So each simulated node gets two cgroups: an *accelerator*, a CFS quota
(cgroup v1 `cpu`, v2 `cpu.max`) pinned to one core (`cpuset`) with a weight far above everything
else's, which a worker moves itself into when it starts training (`train/sim_accelerator.py`);
and a *host*, no quota, any core, where the agent and everything it starts run.

Measured on a 2-core x86-64 VM: with the whole node in one 0.44-CPU quota, rank 0's node gives
0.10 CPU of it to its uploader and agent and sets the whole world's pace (1..4 nodes calibrated
at 16, 28, 47 and 44 samples/s); with 0.375-CPU accelerators, 21, 36, 53 and 68. Quotas alone
(10 ms period, free to run on either core) gave 18, 17, 23 and 37: the 20 ms period and the
pinning matter, as a node out of quota holds every rank's collective until its next period begins.

Each host weighs one ordinary process, as it stands for a machine's CPUs of its own (at one
process's weight for all hosts together, a joining node's imports run at ~0.45 CPU while the
other nodes' agents and uploaders run: 9.2-9.5 s for the zygote's). Weighed so, the hosts
outweigh etcd and the S3 server when the baseline restarts four nodes at once: 2 s leases
expired, the leader fell, and that restart took 207 s to its first step. So the servers the
cluster shares (etcd, the S3 server, the metadata servers: the cloud, not a node) get a cgroup of
their own (`serve_here`) weighed above every host: they are light but latency-bound.

A GPU world all-reduces over NCCL and the network, which no node's host work slows. Here torch's
gloo process group reduces and sends on its own threads. On the hosts, in a torch replay (hours
4.25-5.25, K=4, 2-core x86-64 VM), a world of 4 trained at 86.1 samples/s while nothing ran beside
it and at 57.1 while the nodes rebuilt their standbys, and worlds of 2 and 3 at 49.1 and 64.4
against 60.4 and 74.7 while a joining node, another machine, imported torch. So the cluster gets
an *interconnect*: one cgroup, no quota, any core, weighed as the accelerators, where a worker
moves the process group's communication threads (`train/sim_accelerator.py`; cgroup v1, which
places threads). There: 84.2 against 87.0 beside the rebuilds, 52.0 and 71.6 against 58.9 and
74.5 beside a joiner's imports. Horovod's threads go there too (named by the worker as
`hvd.init()` starts them); they burn 0.21 CPU per node wherever they run.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

from elasticyolo.worker_runtime.worker_env import ENV_SIM_ACCELERATOR, ENV_SIM_INTERCONNECT

V1_ROOT = Path("/sys/fs/cgroup/cpu")
V1_CPUSET = Path("/sys/fs/cgroup/cpuset")
V2_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 20_000


class CpuSliceError(RuntimeError):
    pass


def _v2_root() -> Path | None:
    controllers = V2_ROOT / "cgroup.controllers"
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        return V2_ROOT
    return None


def _writable(root: Path) -> bool:
    return os.access(root, os.W_OK)


def cgroup_root() -> tuple[Path, int] | None:
    """Where CPU quotas can be made here: (root, cgroup version), or None."""
    if (V1_ROOT / "cpu.cfs_quota_us").is_file() and _writable(V1_ROOT):
        return V1_ROOT, 1
    v2 = _v2_root()
    if v2 is not None and _writable(v2):
        return v2, 2
    return None


def host_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def default_cpus_per_node(nodes: int, reserve: float = 0.5) -> float:
    """Each node's accelerator: the host's cores minus `reserve` (the nodes' hosts, etcd, the S3
    server, the replay itself), split evenly over the nodes, and no more than the busiest core
    can give each of the accelerators pinned to it."""
    cores = len(host_cpus())
    per_core = -(-max(1, nodes) // cores)
    return max(0.05, min((cores - reserve) / max(1, nodes), (1 - reserve / cores) / per_core))


class CpuSlices:
    """Per simulated node, two cgroups: its accelerator, a quota of `cpus` CPUs pinned to one core
    at a weight far above everything else's (so the quota is what it gets, whatever else runs),
    and its host, no quota, any core, one ordinary process's weight per node (beside the servers'
    cgroup, weighed above them, for etcd, the S3 server, the metadata servers and the replay).

    `prefix(node)` is a command prefix that moves the started process (an agent) into the node's
    host cgroup before it execs (its children, the node's workers, inherit it) and tells it where
    the accelerator is (`train/sim_accelerator.py`): a worker moves itself there when it starts
    training. `parent` holds the accelerators, `host_parent` the hosts, `interconnect` (one for the
    cluster, no quota, the accelerators' weight) the workers' communication threads."""

    ACCEL_WEIGHT = {1: 262144, 2: 10000}  # cpu.shares (v1, max) / cpu.weight (v2, max)
    PROCESS_WEIGHT = {1: 1024, 2: 100}  # an ordinary process's (v1 shares, v2 weight)
    SERVERS_PROCESSES = 16  # the servers' weight, in ordinary processes: above any host's

    def __init__(self, cpus: float, name: str | None = None, nodes: int = 1) -> None:
        """`nodes`: how many nodes the hosts stand for; each weighs one ordinary process."""
        found = cgroup_root()
        if found is None:
            raise CpuSliceError("no writable cgroup CPU controller (cgroup v1 cpu or v2 cpu.max) on this host")
        self.root, self.version = found
        self.cpus = cpus
        name = name or f"elasticyolo-{uuid.uuid4().hex[:8]}"
        self.parent = self.root / name
        self.host_parent = self.root / f"{name}-host"
        self.servers = self.root / f"{name}-servers"
        self.interconnect = self.root / f"{name}-interconnect"
        self.parent.mkdir()
        self.host_parent.mkdir()
        self.servers.mkdir()
        self.interconnect.mkdir()
        self.served: list[Path] = []  # where serve_here found this process
        process = self.PROCESS_WEIGHT[self.version]
        for group, weight in ((self.parent, self.ACCEL_WEIGHT[self.version]),
                              (self.host_parent, process * max(1, nodes)),
                              (self.servers, process * self.SERVERS_PROCESSES),
                              (self.interconnect, self.ACCEL_WEIGHT[self.version])):
            (group / ("cpu.shares" if self.version == 1 else "cpu.weight")).write_text(str(weight))
        # cgroup v1 keeps cpuset in a hierarchy of its own; v2 has it beside cpu.
        self.pin_root: Path | None = None
        if self.version == 2:
            for p in (self.parent, self.host_parent):
                (p / "cgroup.subtree_control").write_text("+cpu")
            try:
                (self.parent / "cgroup.subtree_control").write_text("+cpuset")
                self.pin_root = self.parent
            except OSError:
                pass
        elif (V1_CPUSET / "cpuset.cpus").is_file() and _writable(V1_CPUSET):
            self.pin_root = V1_CPUSET / name
            self.pin_root.mkdir()
            for f in ("cpuset.cpus", "cpuset.mems"):
                (self.pin_root / f).write_text((V1_CPUSET / f).read_text())
        self.accelerators: dict[str, Path] = {}
        self.hosts: dict[str, Path] = {}
        self.pins: dict[str, tuple[Path, int]] = {}
        self.released: set[str] = set()

    def _accelerator_group(self, node: str) -> Path:
        path = self.accelerators.get(node)
        if path is None:
            path = self.parent / node
            path.mkdir(exist_ok=True)
            quota = max(1000, int(self.cpus * PERIOD_US))
            if self.version == 1:
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            self.accelerators[node] = path
        return path

    def _host(self, node: str) -> Path:
        if node not in self.hosts:
            self.hosts[node] = self.host_parent / node
            self.hosts[node].mkdir(exist_ok=True)
        return self.hosts[node]

    def _pin(self, node: str) -> Path | None:
        """The accelerator's cpuset: the core with the fewest nodes pinned to it that were not
        released."""
        if self.pin_root is None:
            return None
        if node not in self.pins:
            load = {cpu: 0 for cpu in host_cpus()}
            for other, (_, cpu) in self.pins.items():
                if other not in self.released:
                    load[cpu] += 1
            cpu = min(load, key=lambda c: (load[c], c))
            path = self.pin_root / node if self.pin_root != self.parent else self._accelerator_group(node)
            path.mkdir(exist_ok=True)
            if self.version == 1:
                (path / "cpuset.mems").write_text((self.pin_root / "cpuset.mems").read_text())
            (path / "cpuset.cpus").write_text(str(cpu))
            self.pins[node] = (path, cpu)
        return self.pins[node][0]

    def accelerator(self, node: str) -> list[Path]:
        """The `cgroup.procs` files a process writes its pid to to train on the node's accelerator."""
        groups = [self._accelerator_group(node)]
        pin = self._pin(node)
        if pin is not None and pin != groups[0]:
            groups.append(pin)
        return [g / "cgroup.procs" for g in groups]

    def environment(self, node: str) -> dict[str, str]:
        """What a node's processes find in their environment: where its workers move to train
        (`train/sim_accelerator.py`)."""
        env = {ENV_SIM_ACCELERATOR: os.pathsep.join(str(p) for p in self.accelerator(node))}
        if self.version == 1:  # threads are placed one by one in cgroup v1 only (`sim_accelerator.enter`)
            env[ENV_SIM_INTERCONNECT] = str(self.interconnect / "cgroup.procs")
        return env

    def prefix(self, node: str) -> list[str]:
        """A command prefix that starts a program on the node's host, with `environment(node)`."""
        host = self._host(node) / "cgroup.procs"
        exports = " ".join(f"{k}={v}" for k, v in self.environment(node).items())
        return ["sh", "-c", f'echo $$ > {host} && export {exports} && exec "$@"', "sh"]

    def place_on_host(self, node: str, pids: list[int]) -> None:
        """Move running processes (a node's daemons that were started elsewhere) to the node's host;
        what they start later inherits it."""
        procs = self._host(node) / "cgroup.procs"
        for pid in pids:
            try:
                procs.write_text(str(pid))
            except (ProcessLookupError, OSError):
                pass  # exited meanwhile

    def _own_group(self) -> Path:
        """This process's cgroup in the CPU hierarchy."""
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            if (self.version == 1 and "cpu" in controllers.split(",")) or (self.version == 2 and not controllers):
                return self.root / path.lstrip("/")
        return self.root

    def serve_here(self) -> None:
        """Move this process (the one that starts the cluster's servers: they inherit it) into
        the servers' cgroup; `close` moves it back."""
        self.served.append(self._own_group())
        (self.servers / "cgroup.procs").write_text(str(os.getpid()))

    def release(self, node: str) -> None:
        """The node is gone (killed, drained): its core takes the next node. Its cgroups stay
        until `close` (a dying process may still be in them)."""
        self.released.add(node)

    def core_of(self, node: str) -> int | None:
        return self.pins[node][1] if node in self.pins else None

    def throttled_s(self) -> dict[str, float]:
        """Seconds each node's accelerator spent throttled (its quota used up): a check that the quotas bind."""
        out = {}
        for node, path in self.accelerators.items():
            stat = dict(line.split() for line in (path / "cpu.stat").read_text().splitlines() if line.strip())
            usec = int(stat.get("throttled_usec", 0)) or int(stat.get("throttled_time", 0)) // 1000
            out[node] = usec / 1e6
        return out

    def close(self) -> None:
        """Kill what is left in the slices, then remove them (a cgroup with processes stays)."""
        pins = [p for p, _ in self.pins.values() if p not in self.accelerators.values()]
        groups = [*self.accelerators.values(), *self.hosts.values(), *pins]
        for path in groups:
            try:
                pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.served:  # back where it was; the servers themselves were stopped by their owners
            (self.served[0] / "cgroup.procs").write_text(str(os.getpid()))
        self.served.clear()
        tops = [self.parent, self.host_parent, self.servers, self.interconnect] + (
            [self.pin_root] if self.pin_root not in (None, self.parent) else [])
        for path in [*groups, *tops]:
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # the killed processes are still exiting
        self.accelerators.clear()
        self.hosts.clear()
        self.pins.clear()
        self.released.clear()

    def __enter__(self) -> "CpuSlices":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

