"""The Ray engine's training actor: one per slot, placed by the job's controller (`controller.py`)
in the slot's bundle of its node's placement group.

The actor is the torch engine's worker (`engines/torch/worker.py`, `TorchWorld`) with another
`connect()`: its process-group store is the controller's `TCPStore` (`store.py`) and its worlds
come from the controller (`world_source.py`), which decides them with the torch engine's
`plan_world`. Everything else is the torch engine's: the process group re-formed in place on
every world change, the state kept in memory at each commit, the state agreement, the snapshots
and the store checkpoints, rank 0's run folder.

* `__init__` pre-warms (the model built, a first step taken, the loader up, the checkpoint store
  checked) before the actor is offered any world: a joiner costs the running world one commit;
* `train()` joins and trains until the job ends (`done` on rank 0, `finished` on the others) or
  this slot leaves (`left`: a drain); a failed collective is re-formed in place inside it;
* `leave()` asks to leave at the next commit (the torch worker's SIGTERM path);
* slot 0 of each node runs the project's spot watcher (`spot/`) for its node and reports a
  notice to the controller, which drains the node.

Rank 0's progress, resume and checkpoint records go to Ray's GCS KV (`records.py`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import elasticyolo.train  # noqa: F401  (offline Ultralytics before anything imports it)
import ray

from elasticyolo.engines.ray import lifeline
from elasticyolo.engines.ray.store import AbortableStore
from elasticyolo.engines.ray.world_source import RayWorldSource
from elasticyolo.engines.torch.worker import ENTER_TIMEOUT_S, ENV_SLOT, ENV_SLOTS, PreparedWorker, TorchWorld, \
    prepare_worker
from elasticyolo.engines.torch.world_watch import WorldSource
from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.worker_runtime.collective_abort import CollectiveAborter
from elasticyolo.worker_runtime.runner import WorkerRunner

log = get_logger("elasticyolo.ray.worker")


@dataclass(frozen=True)
class SlotSetup:
    """What the controller hands each training actor."""

    spec_json: str
    job: str
    generation: int
    node: str  # the job's name for the node (`controller.node_name`)
    slot: int
    slots: int
    work_root: str  # node-local: `<work_root>/<job>/<node>/<generation>/` (snapshots, run folder)
    store_host: str
    store_port: int
    lifeline_port: int  # the controller's `lifeline.LifelineServer`
    controller: Any  # the controller's actor handle
    notices: dict[str, Any] = field(default_factory=dict)  # spot watcher options (`spot.make_watcher`)


class RayWorld(TorchWorld):
    """`TorchWorld` whose store and worlds are the Ray job controller's."""

    def __init__(self, spec: TrainSpec, prepared: PreparedWorker | None, setup: SlotSetup) -> None:
        super().__init__(spec, prepared)
        self.setup = setup

    @property
    def cuda_index(self) -> int:
        return ray_cuda_index(self.local_rank)

    def connect(self, runner: WorkerRunner) -> tuple[Any, Callable[[int], WorldSource]]:
        s = self.setup
        # An abort shuts this process's collective connections (`TorchWorld._on_world`); Ray's own
        # (to the raylet, the GCS, the controller, and into this actor), the lifeline and the store's
        # must stay. They are the ones open before the process group exists, and those to the
        # store's port.
        ray.get(s.controller.hello.remote(), timeout=60)  # Ray's connection to the controller: open now
        self.lifeline = lifeline.connect(s.store_host, s.lifeline_port, s.node, s.slot)
        ray_ports = tcp_local_ports()
        self.aborter = CollectiveAborter(kept=lambda: (ray_ports, {s.store_port}))
        store = AbortableStore(s.store_host, s.store_port, timedelta(seconds=ENTER_TIMEOUT_S))
        return store, lambda incarnation: RayWorldSource(s.controller, s.store_host, s.store_port, s.generation,
                                                         s.node, self.local_rank, incarnation)

    def request_leave(self) -> None:
        stop = getattr(self, "_sigterm", None)  # set by join()
        if stop is not None:
            stop()
        else:
            self.leave_requested.set()


def tcp_local_ports() -> set[int]:
    """The local ports of this process's TCP sockets (connections and listeners)."""
    import psutil

    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.laddr}


def ray_cuda_index(slot: int) -> int:
    """Ray shows an actor only the GPUs it was given (`CUDA_VISIBLE_DEVICES`): its GPU is 0."""
    return 0 if ray.get_gpu_ids() else slot


class TrainingActor:
    """The body of a training actor (`controller.py` makes it a Ray actor with its resources)."""

    def __init__(self, setup: SlotSetup) -> None:
        from elasticyolo.priority import as_worker
        from elasticyolo.train.core import TrainCore, quiet_ultralytics
        from elasticyolo.worker_runtime import worker_env

        as_worker()  # a node's Ray daemons may run above their workers (docs/ray-engine.md); training does not
        self.setup = setup
        worker_dir = worker_env.node_work_dir(setup.work_root, setup.job, setup.node, setup.generation,
                                              prune=setup.slot == 0)
        os.environ.update({worker_env.ENV_JOB: setup.job, worker_env.ENV_NODE_ID: setup.node,
                           worker_env.ENV_GENERATION: str(setup.generation),
                           worker_env.ENV_WORKER_DIR: str(worker_dir), ENV_SLOT: str(setup.slot),
                           ENV_SLOTS: str(setup.slots)})
        os.chdir(worker_dir)
        self.spec = TrainSpec.from_json(setup.spec_json, where="the Ray job's spec")
        quiet_ultralytics()
        core = TrainCore(self.spec, rank=0, world=1, local_rank=ray_cuda_index(setup.slot),
                         work_dir=worker_env.read().run_dir, local_size=setup.slots)
        core.warm_up()  # its first step would otherwise stall the world it joins
        self.prepared = prepare_worker(self.spec, core)
        core.loader.wait_ready(timeout=300)
        self.world = RayWorld(self.spec, self.prepared, setup)
        self.watcher = self._watch_notices() if setup.slot == 0 else None
        log.info("training actor ready", node=setup.node, slot=setup.slot, pid=os.getpid())

    def _watch_notices(self) -> Any:
        if not self.setup.notices:
            return None
        from elasticyolo.spot.factory import make_watcher

        options = dict(self.setup.notices)
        notice_file = options.pop("notice_file", None)
        if notice_file:
            notice_file = str(notice_file).replace("{node}", self.setup.node)
        watcher = make_watcher(notice_file=notice_file, **options)
        controller, node = self.setup.controller, self.setup.node
        watcher.start(lambda notice: controller.notice.remote(node, notice.to_record()))
        return watcher

    def pid(self) -> int:
        return os.getpid()

    def leave(self) -> None:
        self.world.request_leave()

    def train(self) -> dict[str, Any]:
        from elasticyolo.cluster.keys import JobKeys
        from elasticyolo.engines.ray.engine import ENGINE
        from elasticyolo.engines.ray.records import GcsKV
        from elasticyolo.worker_runtime.progress import EtcdProgress

        progress = EtcdProgress(GcsKV(), JobKeys(self.setup.job), node_id=self.setup.node)  # type: ignore[arg-type]
        runner = WorkerRunner(self.spec, self.world, commit_target_s=ENGINE.commit_target_s, sinks=[progress],
                              progress=progress, store=self.prepared.store)
        try:
            summary = runner.run()
        finally:
            if self.world.watch is not None:
                self.world.watch.stop()
            if self.watcher is not None:
                self.watcher.stop()
            progress.flush()
        result = "left" if summary is None else ("done" if runner.core.rank == 0 else "finished")
        return {"result": result, "pid": os.getpid(), "node": self.setup.node, "slot": self.setup.slot,
                "step": runner.core.progress.step}
