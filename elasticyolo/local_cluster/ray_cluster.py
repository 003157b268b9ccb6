"""A Ray cluster of several nodes on this host, for tests and benchmarks of `engine=ray`
(`ray.cluster_utils.Cluster`: one GCS and raylet per node, real processes).

The head node holds no slot (0 CPUs): it runs the GCS and the job controllers. Each training node
has `cpus` CPUs and a `node-<n>` resource of 1 naming it. Ray's failure detection is tightened
(a health check every 0.5 s that times out after 0.5 s, a node dead after 3 failed) so a dead or
frozen node is declared dead within about 2-3 s, as a cluster would be configured for fast
recovery (Ray's defaults wait longer: a frozen raylet's health checks each wait out their timeout).
The head's and `add`'s nodes' Ray daemons run at the agent's priority (`priority.as_node_daemon`)
and their training actors at normal priority, as docs/ray-engine.md says to run a node: otherwise
training and a CPU hog beside it starve the health checks, and Ray declares a healthy node dead.
`start_node`'s nodes (the replay's) run at this process's priority.

Ray's nodes advertise, and are reached on, the address of the interface that holds the default
route. The cluster is made inside a namespace with only `lo` up and no route
(`local_cluster/netns.py`, `LoopbackNamespace().entered()`), where that address is 127.0.0.1:
its nodes, their workers and the driver (this process) all talk over that namespace's loopback.
It refuses to start where Ray would pick another address.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

from elasticyolo.priority import as_node_daemon
from elasticyolo.processes import process_tree, signal_each

HEALTH_CHECK = {"health_check_period_ms": 500, "health_check_timeout_ms": 500, "health_check_failure_threshold": 3,
                "health_check_initial_delay_ms": 0}
# For long runs on a busy host (benchmarks at low priority): a raylet starved of CPU for a few
# seconds is not declared dead (a dead node is, within about 10-20 s).
TOLERANT_HEALTH_CHECK = {**HEALTH_CHECK, "health_check_period_ms": 1000, "health_check_timeout_ms": 1000,
                         "health_check_failure_threshold": 10}


LOOPBACK = "127.0.0.1"
OBJECT_STORE_BYTES = 150 * 1024 * 1024  # per node, as `ray.cluster_utils.Cluster` (a training job stores little)
# The ports a node listens on besides its workers' (which bind port 0 each).
NODE_PORT_OPTIONS = ("--node-manager-port", "--object-manager-port", "--runtime-env-agent-port",
                     "--dashboard-agent-grpc-port", "--dashboard-agent-listen-port", "--metrics-export-port")


class LocalRayCluster:
    def __init__(self, env: dict[str, str] | None = None, health_check: dict[str, int] | None = None) -> None:
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        os.environ.update(env or {})  # the nodes' processes (and so the actors) inherit it
        import ray
        from ray._raylet import node_ip_address_from_perspective
        from ray.cluster_utils import Cluster

        found = node_ip_address_from_perspective()  # what each node and the driver will advertise
        if found != LOOPBACK:
            raise RuntimeError(f"Ray would advertise {found}, not {LOOPBACK}: make the cluster inside a "
                               "LoopbackNamespace (elasticyolo/local_cluster/netns.py)")

        head = {"num_cpus": 0, "include_dashboard": False, "_system_config": health_check or HEALTH_CHECK}
        try:
            self.cluster = Cluster(initialize_head=True, head_node_args=head)
        except Exception:  # noqa: BLE001 - Ray gives a raylet 30 s to register: once more on a loaded host
            ray.shutdown()
            self.cluster = Cluster(initialize_head=True, head_node_args=head)
        self._as_node_daemons(self.cluster.head_node)
        self.address = self.cluster.address
        self.nodes: dict[str, Any] = {}
        self._count = 0
        self._ports_given: set[int] = set()
        self.temp_root = Path(tempfile.mkdtemp(prefix="eyray-", dir="/tmp"))  # `start_node`'s nodes
        ray.init(address=self.address, namespace="elasticyolo", log_to_driver=False, logging_level="ERROR",
                 configure_logging=False)

    def add(self, cpus: int = 1, env: dict[str, str] | None = None) -> Any:
        """A training node; returns Ray's node object (`.node_id`). `env`: its raylet's environment
        on top of this process's, which the node's workers (the actors) inherit."""
        self._count += 1
        name = f"node-{self._count}"
        node = self.cluster.add_node(num_cpus=cpus, resources={name: 1}, env_vars=env or None)  # waits for it
        self._as_node_daemons(node)
        self.nodes[node.node_id] = node
        return node

    @staticmethod
    def _daemons(node: Any) -> list[int]:
        """The processes Ray started for a node (raylet and agents, GCS on the head; not its workers)."""
        return [info.process.pid for infos in node.all_processes.values() for info in infos
                if info.process is not None]

    @classmethod
    def _as_node_daemons(cls, node: Any) -> None:
        """A node's Ray daemons (raylet, GCS on the head, and what they started: Ray's agents) at
        the agent's priority, as a node started by `nice -n -5 ray start`
        (docs/ray-engine.md): a host whose CPUs training fills does not starve its health checks.
        The workers they start later inherit it; training actors drop back to normal priority
        (`priority.as_worker`)."""
        for pid in {p for daemon in cls._daemons(node) for p in process_tree(daemon)}:
            as_node_daemon(pid)

    def start_node(self, cpus: int = 1, env: dict[str, str] | None = None,
                   prefix: Sequence[str] = ()) -> tuple[str, subprocess.Popen[bytes]]:
        """A node started as a VM joins a cluster, `ray start --address HEAD --block`, and not
        waited for: returns its resource name (`node-<n>`, for `node_id_of`) and the `ray start`
        process, whose children are every process of the node (`prefix`, a command prefix, runs
        it on a host of its own: `cpu_slices.CpuSlices.prefix`). At this process's priority: the
        replay measures its nodes so (docs/benchmarks.md)."""
        from elasticyolo.local_cluster.servers import free_ports

        self._count += 1
        name = f"node-{self._count}"
        # Nodes starting side by side on one host collide where each picks its own: their ports
        # (chosen here instead) and their sockets' and logs' names in the session directory (each
        # node gets a temporary directory of its own). A raylet that loses aborts on `bind:
        # Address already in use`.
        ports = free_ports(len(NODE_PORT_OPTIONS), avoid=self._ports_given)
        self._ports_given.update(ports)
        temp_dir = self.temp_root / name  # short: a socket's path must fit in 107 bytes
        cmd = [*prefix, str(Path(sys.executable).with_name("ray")), "start", "--address", self.address,
               "--temp-dir", str(temp_dir),
               "--node-ip-address", LOOPBACK, "--num-cpus", str(cpus), "--resources", json.dumps({name: 1}),
               "--object-store-memory", str(OBJECT_STORE_BYTES), "--disable-usage-stats", "--block",
               "--min-worker-port", "0", "--max-worker-port", "0",  # each worker binds a port the kernel picks
               *(arg for option, port in zip(NODE_PORT_OPTIONS, ports) for arg in (option, str(port)))]
        proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        return name, proc

    def node_id_of(self, resource: str) -> str | None:
        """The Ray node id of the live node started with `start_node` under that name; None before
        it has registered."""
        import ray

        return next((n["NodeID"] for n in ray.nodes() if n["Alive"] and resource in n.get("Resources", {})), None)

    def head_node_id(self) -> str:
        return self.cluster.head_node.node_id

    def node_addresses(self) -> set[str]:
        """The addresses the cluster's live nodes advertise (Ray's node table)."""
        import ray

        return {n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}

    def kill(self, node_id: str) -> None:
        """Every process of the node killed at once (a VM gone): its raylet, its agents and its
        workers (the raylet's children: a worker outlives its raylet by up to a second, and trains
        on meanwhile), then Ray's own clean-up of the node."""
        signal_each(self.processes(node_id), signal.SIGKILL)
        self.cluster.remove_node(self.nodes.pop(node_id), allow_graceful=False)

    def pids(self, node_id: str) -> list[int]:
        """The processes Ray started for the node (raylet and agents; not its workers)."""
        return self._daemons(self.nodes[node_id])

    def processes(self, node_id: str) -> list[int]:
        """Every process of the node: Ray's daemons and what they started (its workers)."""
        return [p for pid in self.pids(node_id) for p in process_tree(pid)]

    def remove_all(self) -> None:
        for node_id in list(self.nodes):
            self.kill(node_id)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        shutil.rmtree(self.temp_root, ignore_errors=True)

