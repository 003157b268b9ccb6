"""What an agent tells the processes it starts (workers, a torch elastic launcher), through their
environment: `WorkerEnv.to_env()` writes it, `read()` reads it. One set of names for every engine.

The environment, not the command line (visible in `ps`) nor etcd, because it carries the etcd
password. Variables a child inherits from the agent's own environment unchanged (`ELASTICYOLO_TRACE_DIR`,
`ELASTICYOLO_SNAPSHOT_S`, `ELASTICYOLO_LOG_*`) are read here too but never written.

Node-local files of a job live in one directory per (job, node, submission):
`<work root>/<job>/<node-id>/<spec revision>/` (`node_work_dir`), the workers' working directory;
its `snapshots/` holds the node-local snapshot (`train/snapshots.py`). A new submission gets a new
directory and older ones are deleted, so a resubmitted job never restores a previous run's state.
"""

from __future__ import annotations

import os
import select
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.settings import ENV_JOB, EtcdSettings

if TYPE_CHECKING:
    from elasticyolo.cluster.etcd import EtcdClient

ENV_SPEC = "ELASTICYOLO_SPEC"  # the job's TrainSpec as JSON
ENV_NODE_ID = "ELASTICYOLO_NODE_ID"
ENV_GENERATION = "ELASTICYOLO_GENERATION"  # the submission (spec mod revision) the worker trains
ENV_WORKER_DIR = "ELASTICYOLO_WORKER_DIR"  # node_work_dir(): cwd and snapshot home
ENV_PARENT_PID = "ELASTICYOLO_PARENT_PID"  # the process that must outlive this one (worker_runtime/lifeline.py)
ENV_TERM = "ELASTICYOLO_DRIVER_TERM"  # leadership term of the coordinator that launched the worker
ENV_RESTORE = "ELASTICYOLO_RESTORE"  # "1": a freshly started world; agree on the newest snapshot
ENV_ENGINE_CONFIG = "ELASTICYOLO_ENGINE_CONFIG"  # an engine's own settings for its node process (JSON)
ENV_SNAPSHOT_S = "ELASTICYOLO_SNAPSHOT_S"  # inherited override of the engine's snapshot period
# A replacement warm worker (worker_runtime/prewarm.py) waits this long before anything heavy, so that it
# does not take the CPU from the worker it replaces while that one restores and takes its first steps.
ENV_PREWARM_DELAY_S = "ELASTICYOLO_PREWARM_DELAY_S"
# A node simulated on CPUs (local_cluster/cpu_slices.py, inherited): the `cgroup.procs` files
# (os.pathsep-separated) a worker moves itself to when it starts training (train/sim_accelerator.py).
ENV_SIM_ACCELERATOR = "ELASTICYOLO_SIM_ACCELERATOR"
# ...and the `cgroup.procs` file of the cluster's simulated interconnect, where the process group's
# communication threads go (cgroup v1 only).
ENV_SIM_INTERCONNECT = "ELASTICYOLO_SIM_INTERCONNECT"

DEFAULT_WORK_ROOT = "/var/tmp/elasticyolo"  # survives reboots, unlike a tmpfs /tmp


def wait_prewarm_delay() -> None:
    """A warm worker's first act: wait `ELASTICYOLO_PREWARM_DELAY_S` before importing anything
    heavy (the spec's pydantic, torch, Ultralytics: ~0.5 s of CPU before the model is even built).
    An environment that arrives on stdin meanwhile (`PrewarmPool.take(ready_only=False)`) ends the
    wait; the line stays unread for `prewarm.serve`."""
    delay = float(os.environ.get(ENV_PREWARM_DELAY_S) or 0)
    if delay > 0:
        select.select([sys.stdin], [], [], delay)


@dataclass(frozen=True)
class WorkerEnv:
    etcd: EtcdSettings = field(default_factory=EtcdSettings)
    job: str | None = None
    node_id: str | None = None
    spec_json: str | None = None
    generation: int | None = None
    worker_dir: str | None = None
    parent_pid: int | None = None
    term: int | None = None
    restore: bool = False
    engine_config: str | None = None
    snapshot_period_s: float | None = None

    def to_env(self) -> dict[str, str]:
        """The variables for a child's environment (unset fields are left out)."""
        out = self.etcd.to_env()
        for name, value in ((ENV_JOB, self.job), (ENV_NODE_ID, self.node_id), (ENV_SPEC, self.spec_json),
                            (ENV_GENERATION, self.generation),
                            (ENV_WORKER_DIR, self.worker_dir), (ENV_PARENT_PID, self.parent_pid),
                            (ENV_TERM, self.term), (ENV_ENGINE_CONFIG, self.engine_config),
                            (ENV_SNAPSHOT_S, self.snapshot_period_s)):
            if value is not None:
                out[name] = str(value)
        if self.restore:
            out[ENV_RESTORE] = "1"
        return out

    @property
    def connected(self) -> bool:
        """Started by an agent: etcd and the job are known, so the worker reports to etcd."""
        return bool(self.etcd.endpoints and self.job)

    def etcd_client(self, timeout: float) -> "tuple[EtcdClient, JobKeys] | None":
        """(client, keys) for this worker's job, or None when not started by an agent. `timeout`
        bounds each request and its retries: a worker must never stall a step on etcd."""
        if not self.connected:
            return None
        assert self.job is not None
        return self.etcd.client(timeout=timeout, retry_window=timeout), JobKeys(self.job)

    @property
    def snapshot_dir(self) -> Path | None:
        return Path(self.worker_dir) / "snapshots" if self.worker_dir else None

    @property
    def run_dir(self) -> Path:
        """Ultralytics' run folder of this node's workers (engine=torch)."""
        return Path(self.worker_dir or "runs/elasticyolo") / "run"

    def snapshot_period(self, default: float) -> float:
        return default if self.snapshot_period_s is None else self.snapshot_period_s


def read(environ: Mapping[str, str] | None = None) -> WorkerEnv:
    """This process's `WorkerEnv` (empty fields when it was not started by an agent)."""
    env = os.environ if environ is None else environ

    def number(name: str, kind: type) -> object:
        raw = env.get(name)
        try:
            return kind(raw) if raw not in (None, "") else None
        except ValueError:
            return None

    return WorkerEnv(
        etcd=EtcdSettings.from_env(env), job=env.get(ENV_JOB) or None, node_id=env.get(ENV_NODE_ID) or None,
        spec_json=env.get(ENV_SPEC) or None, generation=number(ENV_GENERATION, int),  # type: ignore[arg-type]
        worker_dir=env.get(ENV_WORKER_DIR) or None,
        parent_pid=number(ENV_PARENT_PID, int),  # type: ignore[arg-type]
        term=number(ENV_TERM, int),  # type: ignore[arg-type]
        restore=env.get(ENV_RESTORE) == "1", engine_config=env.get(ENV_ENGINE_CONFIG) or None,
        snapshot_period_s=number(ENV_SNAPSHOT_S, float),  # type: ignore[arg-type]
    )


def node_work_dir(root: str | os.PathLike[str], job: str, node_id: str, generation: int,
                  prune: bool = True) -> Path:
    """This node's directory for one submission of `job` (created). With `prune`, the directories
    of other submissions are deleted first (their snapshots must never be restored); callers whose
    old workers may still be running prune later."""
    base = Path(root) / job / node_id
    if prune and base.is_dir():
        for old in base.iterdir():
            if old.name != str(generation):
                shutil.rmtree(old, ignore_errors=True)
    path = base / str(generation)
    path.mkdir(parents=True, exist_ok=True)
    return path
