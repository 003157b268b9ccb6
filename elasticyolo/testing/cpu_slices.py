"""One CPU share per simulated node: local agents that behave like separate machines.

On one host, simulated nodes share its cores: a node's throughput then depends on what every
other process does, so more nodes need not train faster and a joiner's start-up slows the world
it joins (measured on 2 cores: 4 nodes calibrated at 33, 73 and 65 samples/s in one run). Each
node gets a CFS quota (cgroup v1 `cpu`, v2 `cpu.max`) and is pinned to one core (`cpuset`), as a
VM has its own cores. Measured on 2 cores, 1..4 nodes of 0.44 CPU: quotas alone (10 ms period,
free to run on either core) 18, 17, 23, 37 samples/s; pinned with a 20 ms period 20, 34, 50, 76.
The period stays short because a node out of quota holds every rank's collective until its next
period begins.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

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


def default_cpus_per_node(nodes: int, reserve: float = 0.25) -> float:
    """The host's cores minus `reserve` (etcd, the S3 server, the replay itself), split evenly
    over the nodes, and no more than the busiest core can give each of the nodes pinned to it."""
    cores = len(host_cpus())
    per_core = -(-max(1, nodes) // cores)
    return max(0.05, min((cores - reserve) / max(1, nodes), (1 - reserve / cores) / per_core))


class CpuSlices:
    """A parent cgroup for one run with one child per node, each with `cpus` CPUs of quota.

    `prefix(node)` is a command prefix that moves the started process into the node's cgroup
    before it execs (its children, the node's workers, inherit it)."""

    def __init__(self, cpus: float, name: str | None = None) -> None:
        found = cgroup_root()
        if found is None:
            raise CpuSliceError("no writable cgroup CPU controller (cgroup v1 cpu or v2 cpu.max) on this host")
        self.root, self.version = found
        self.cpus = cpus
        name = name or f"elasticyolo-{uuid.uuid4().hex[:8]}"
        self.parent = self.root / name
        self.parent.mkdir()
        # cgroup v1 keeps cpuset in a hierarchy of its own; v2 has it beside cpu.
        self.pin_root: Path | None = None
        if self.version == 2:
            (self.parent / "cgroup.subtree_control").write_text("+cpu")
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
        self.nodes: dict[str, Path] = {}
        self.pins: dict[str, tuple[Path, int]] = {}
        self.released: set[str] = set()

    def _make(self, node: str) -> Path:
        path = self.nodes.get(node)
        if path is None:
            path = self.parent / node
            path.mkdir(exist_ok=True)
            quota = max(1000, int(self.cpus * PERIOD_US))
            if self.version == 1:
                (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (path / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                (path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            self.nodes[node] = path
        return path

    def _pin(self, node: str) -> Path | None:
        """The node's cpuset: the core with the fewest nodes pinned to it that were not released."""
        if self.pin_root is None:
            return None
        if node not in self.pins:
            load = {cpu: 0 for cpu in host_cpus()}
            for other, (_, cpu) in self.pins.items():
                if other not in self.released:
                    load[cpu] += 1
            cpu = min(load, key=lambda c: (load[c], c))
            path = self.pin_root / node if self.pin_root != self.parent else self._make(node)
            path.mkdir(exist_ok=True)
            if self.version == 1:
                (path / "cpuset.mems").write_text((self.pin_root / "cpuset.mems").read_text())
            (path / "cpuset.cpus").write_text(str(cpu))
            self.pins[node] = (path, cpu)
        return self.pins[node][0]

    def prefix(self, node: str) -> list[str]:
        groups = [self._make(node)]
        pin = self._pin(node)
        if pin is not None and pin != groups[0]:
            groups.append(pin)
        moves = " && ".join(f"echo $$ > {g / 'cgroup.procs'}" for g in groups)
        return ["sh", "-c", f'{moves} && exec "$@"', "sh"]

    def release(self, node: str) -> None:
        """The node is gone (killed, drained): its core takes the next node. Its cgroups stay
        until `close` (a dying process may still be in them)."""
        self.released.add(node)

    def core_of(self, node: str) -> int | None:
        return self.pins[node][1] if node in self.pins else None

    def throttled_s(self) -> dict[str, float]:
        """Seconds each node spent throttled (its quota used up): a check that the slices bind."""
        out = {}
        for node, path in self.nodes.items():
            stat = dict(line.split() for line in (path / "cpu.stat").read_text().splitlines() if line.strip())
            usec = int(stat.get("throttled_usec", 0)) or int(stat.get("throttled_time", 0)) // 1000
            out[node] = usec / 1e6
        return out

    def close(self) -> None:
        """Kill what is left in the slices, then remove them (a cgroup with processes stays)."""
        pins = [p for p, _ in self.pins.values() if p not in self.nodes.values()]
        for path in [*self.nodes.values(), *pins]:
            try:
                pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
            except OSError:
                continue
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        tops = [self.parent] + ([self.pin_root] if self.pin_root not in (None, self.parent) else [])
        for path in [*self.nodes.values(), *pins, *tops]:
            for _ in range(50):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.1)  # the killed processes are still exiting
        self.nodes.clear()
        self.pins.clear()
        self.released.clear()

    def __enter__(self) -> "CpuSlices":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

