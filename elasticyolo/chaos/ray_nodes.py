"""A replay's nodes on a local Ray cluster (engine=ray): each replayed node is a Ray node of
`local_cluster/ray_cluster.py` with 1 CPU, which the job's controller takes when it needs a node.

* start: a Ray node joins the cluster, `ray start --address HEAD --block` (what a VM runs at
  boot); with CPU slices the node runs on its host and its actors train on its accelerator
  (`local_cluster/cpu_slices.py`: its command prefix, whose cgroup and environment every process
  of the node inherits);
* notice: a spot notice through the project's spot watcher on the node (slot 0's actor watches a
  notice file named after the node, `--notice-file`), which drains the node;
* kill: every process of the node at once (a VM gone);
* the job's records come from Ray's GCS KV (`engines/ray/records.py`), the workers' traces from
  the replay's trace directory, as for the agents.

This process is the Ray driver (the cluster's `ray.init`); no torch here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticyolo.chaos.nodes import ReplayNodes, store_uri
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.processes import process_tree, signal_each

START_TIMEOUT_S = 120.0  # a Ray node's start (Ray gives a raylet 30 s to register, more on a busy host)

if TYPE_CHECKING:
    from elasticyolo.chaos.nodes import ReplayEnv
    from elasticyolo.local_cluster.ray_cluster import LocalRayCluster


class RayNodes(ReplayNodes):
    def __init__(self, env: ReplayEnv, job: str, workdir: Path, sliced: bool = True, *,
                 cluster: "LocalRayCluster") -> None:
        super().__init__(env, job, workdir, sliced)
        self.cluster = cluster
        self.started: dict[str, tuple[str, subprocess.Popen[bytes]]] = {}  # node -> its resource, `ray start`
        self.ray_ids: dict[str, str] = {}
        self.killed: set[str] = set()
        self.notice_dir = workdir / "notices"
        self.notice_dir.mkdir(parents=True, exist_ok=True)
        self.submitted = False

    def _records(self) -> tuple[Any, Any]:
        from elasticyolo.cluster.keys import JobKeys
        from elasticyolo.engines.ray.records import GcsKV

        return GcsKV(), JobKeys(self.job)

    def start(self, node: str) -> None:
        """`ray start --block` for the node, not waited for (a node takes seconds to start and
        register, and the replay's clock goes on meanwhile, as a cloud's would)."""
        prefix = self.slices.prefix(self.slice_name(node)) if self.slices else ()
        self.started[node] = self.cluster.start_node(cpus=1, prefix=prefix)

    def begin(self, first: str) -> None:
        self.start(first)
        self.ray_id(first)  # registered: the submission finds a node with room

    def ray_id(self, node: str) -> str:
        """The node's Ray node id, once it has registered."""
        if node not in self.ray_ids:
            resource, proc = self.started[node]
            found = wait_for(lambda: self.cluster.node_id_of(resource) or proc.poll() is not None, START_TIMEOUT_S,
                             f"Ray node {node} to register", interval=0.1)
            if found is True:
                raise RuntimeError(f"Ray node {node} exited at start (`ray start` returned {proc.returncode})")
            self.ray_ids[node] = str(found)
        return self.ray_ids[node]

    def submit(self, max_nodes: int) -> None:
        from elasticyolo.engines.ray import job as ray_job

        env_vars = {"ELASTICYOLO_TRACE_DIR": str(self.trace_dir), "OMP_NUM_THREADS": "1", **self.env.s3_env}
        ray_job.submit([*self.env.spec, f"max_nodes={max_nodes}", f"checkpoint={store_uri(self.env)}"], self.job,
                       work_root=str(self.workdir / "nodes"), runtime_env={"env_vars": env_vars},
                       notices={"notice_file": str(self.notice_dir / "{node}"), "poll_interval_s": self.poll_s})
        self.submitted = True

    def ray_name(self, node: str) -> str:
        """The job's name for the node (its records' and traces' `node`)."""
        from elasticyolo.engines.ray.plan import node_name

        return node_name(self.ray_id(node))

    def alive(self, node: str) -> bool:
        return node in self.started and node not in self.killed and self.started[node][1].poll() is None

    def nodes(self) -> list[str]:
        return list(self.started)

    def notice(self, node: str, in_s: float) -> None:
        """The notice file the node's spot watcher reads (written whole: a rename)."""
        path = self.notice_dir / self.ray_name(node)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"deadline": time.time() + in_s, "reason": "replayed spot interruption"}))
        os.replace(tmp, path)

    def kill(self, node: str) -> None:
        """Every process of the node at once (`ray start` and its children: a VM gone)."""
        if node in self.started and node not in self.killed:
            self.killed.add(node)
            proc = self.started[node][1]
            signal_each(process_tree(proc.pid), signal.SIGKILL)
            proc.wait(30)
        if self.slices:
            self.slices.release(self.slice_name(node))

    def job_record(self) -> dict[str, Any]:
        kv, keys = self._records()
        got = kv.get_json(keys.state)
        return got if isinstance(got, dict) else {}

    def checkpoint_epoch(self) -> int | None:
        kv, keys = self._records()
        got = kv.get_json(keys.checkpoint_latest)
        return int(got.get("epoch", -1)) if isinstance(got, dict) else None

    def stop(self) -> None:
        from elasticyolo.engines.ray import job as ray_job

        try:
            if self.submitted:
                self.submitted = False
                ray_job.cancel(self.job, reason="the replay is over")
        finally:
            for node in self.nodes():
                self.kill(node)

