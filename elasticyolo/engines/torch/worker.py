"""A torch elastic training worker: the shared training loop on a torch.distributed process group.

Started by torch's `LocalElasticAgent` (see `launcher.py`) as `elasticyolo worker` (dies with
its launcher), or handed the round's environment as a warm process (`warm.py`). torch elastic
restarts the whole world on every membership change, so each start is a resume:

1. init the process group (gloo on CPU, NCCL on GPU) from torch elastic's env;
2. the newest state in the world: every node's local snapshot and the checkpoint store's latest
   (`train/snapshots.py` `restore_newest`, over `TorchCollectives`);
3. `core.set_world(world, rank)` applies the rescaling policy (LR ramp from the saved progress);
4. train (`worker_runtime/runner.py`, with `TorchWorld` as the engine's part); a commit
   (`worker_runtime/commit.py`) = local snapshot (local rank 0 of every node, every
   commit) + the ranks agree whether one was asked to stop (SIGTERM: the round ends at that
   commit, `stop_at_commit.py`; a request also rides on the next gradient all-reduce and makes
   that step a commit) + store checkpoint when due (rank 0). A failure restarts the world.

Gradients: the core calls `grad_allreduce(grads)` once per optimizer step; we flatten them into
one buffer and all-reduce it (sum / world = mean), which is DDP's math. Not the `DDP` wrapper
itself: the core owns accumulation, ranks with an empty last shard that skip forward/backward
(DDP would hang waiting for their buckets), AMP unscale after the reduce and clipping; DDP's
only extra, overlapping bucket reduces with backward, buys little for a 3-25 M parameter model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import elasticyolo.train  # noqa: F401  (offline Ultralytics before anything imports it)
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from elasticyolo.engines.torch.stop_at_commit import StopAtCommit, torch_reduce
from elasticyolo.errors import UserError
from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.train.checkpointing import open_checked_store
from elasticyolo.train.core import TrainCore
from elasticyolo.train.loop import ProgressSink, Summary
from elasticyolo.train.snapshots import finish_snapshot_on_sigterm
from elasticyolo.worker_runtime import worker_errors
from elasticyolo.worker_runtime.commit import EngineCommit
from elasticyolo.worker_runtime.progress import EtcdProgress
from elasticyolo.worker_runtime.runner import WorkerRunner, WorkerWorld

log = get_logger("elasticyolo.torch.worker")

SNAPSHOT_PERIOD_S = 0.0  # every commit: the snapshot is how a restarted world resumes


# ---- gradients -------------------------------------------------------------------------------
def make_allreduce(world: int, fp16: bool = False,
                   stop: StopAtCommit | None = None) -> Callable[[list[torch.Tensor]], None]:
    """Average gradients in place across the world with one all-reduce on a flat buffer.
    `stop`: its request flag rides in the same buffer (one element: no extra collective)."""

    def allreduce(grads: list[torch.Tensor]) -> None:
        if world == 1 or not grads:
            return
        flat = _flatten_dense_tensors(grads + ([stop.outgoing(grads[0])] if stop is not None else []))
        buf = flat.half() if fp16 and flat.is_cuda else flat
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)  # gloo has no AVG
        if buf is not flat:
            flat.copy_(buf)
        if stop is not None:
            stop.incoming(flat[-1:])
        flat.div_(world)
        for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):  # (the flag, last, is left out)
            g.copy_(r)

    return allreduce


# ---- collectives -----------------------------------------------------------------------------
class TorchCollectives:
    """`train.collectives.Collectives` over the default process group."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # NCCL needs CUDA tensors; gloo takes CPU ones

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def allgather_object(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, device=self.device if self.device.type == "cuda" else None)
        return box[0]

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """One byte tensor (a training state is tens of MB: no pickled object lists)."""
        if self.size == 1:
            assert data is not None
            return data
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        if self.rank == src:
            assert data is not None
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
            size = torch.tensor([payload.numel()], dtype=torch.int64, device=dev)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=dev)
        dist.broadcast(size, src)
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
        dist.broadcast(payload, src)
        return data if self.rank == src and data is not None else payload.cpu().numpy().tobytes()


# ---- entry point -----------------------------------------------------------------------------
def init_process_group(spec: TrainSpec) -> None:
    if not all(os.environ.get(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        raise UserError("engine=torch workers are started by torch elastic (the agents, or torchrun): "
                        "RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT are not set")
    backend = "nccl" if torch.cuda.is_available() and spec.device not in ("cpu",) else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    worker_errors.joined_world()  # from here on, a failure may be a peer's doing (engines/crash_loop.py)
    dist.init_process_group(backend, timeout=timedelta(seconds=spec.gloo_timeout_s))


@dataclass
class PreparedWorker:
    """What a warm process (`worker_runtime/prewarm.py`) builds before it is handed a round."""

    core: TrainCore
    store: Any  # the checkpoint store, opened and checked (None: the job has none)


def prepare_worker(spec: TrainSpec, core: TrainCore) -> PreparedWorker:
    # Any node may come to hold rank 0, which writes the checkpoints: check writing everywhere.
    return PreparedWorker(core, open_checked_store(spec, write=True))


class TorchWorld(WorkerWorld):
    """torch elastic's part of a worker (`worker_runtime/runner.py`): the process group, its
    collectives, the stop agreement at a commit (`StopAtCommit`), and one world per process
    (torch elastic restarts the world on any change, so every start restores the newest state)."""

    snapshot_period_s = SNAPSHOT_PERIOD_S
    close_timeout_s = 30.0

    def __init__(self, spec: TrainSpec, prepared: PreparedWorker | None) -> None:
        self.spec, self.prepared = spec, prepared
        self._local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self._collectives: TorchCollectives | None = None

    @property
    def collectives(self) -> TorchCollectives:
        assert self._collectives is not None, "join() first"
        return self._collectives

    @property
    def local_rank(self) -> int:
        return self._local_rank

    def run_root(self, core: TrainCore) -> Path:
        return Path(core.work_dir).parent  # the worker directory (the core's is `run/` inside it)

    def join(self, runner: WorkerRunner) -> TrainCore:
        init_process_group(self.spec)
        rank, world = dist.get_rank(), dist.get_world_size()
        if self.prepared is None:
            size = os.environ.get("LOCAL_WORLD_SIZE", "")
            core = TrainCore(self.spec, rank=rank, world=world, local_rank=self.local_rank, work_dir=runner.env.run_dir,
                             local_size=int(size) if size.isdigit() else None)
        else:
            core = self.prepared.core
            runner.store = self.prepared.store
            core.progress.world = 0  # built for world 1: the first set_world is not a resize
            core.set_world(world, rank)
        self._collectives = TorchCollectives(core.device)
        return core

    def run(self, runner: WorkerRunner) -> Summary:
        core, env = runner.core, runner.env
        stop = None
        if env.snapshot_dir is not None:
            stop = StopAtCommit(core, torch_reduce(core.device), runner.snapshots, world=core.world)
            finish_snapshot_on_sigterm(runner.snapshots, stop_at_commit=stop.request)
        core.grad_allreduce = make_allreduce(core.world, self.spec.fp16_allreduce, stop)  # before the first step
        restored = runner.restore()
        runner.report_resume(restored)
        return runner.session(stop or EngineCommit(), resume={
            "source": restored.source, "src_rank": restored.src_rank, "node": env.node_id,
            "local_rank": self.local_rank, "restart": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "proc_start": _proc_start(), "run_start": runner.started_at}, source=restored.source)


def _proc_start() -> float | None:
    """When this process was created (unix seconds), to split recovery time into phases."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - diagnostics only
        return None


def main(spec: TrainSpec, *, commit_target_s: float, sinks: list[ProgressSink] | None = None,
         progress: EtcdProgress | None = None, prepared: PreparedWorker | None = None) -> int:
    """The worker entry point (`elasticyolo worker` through the engine registry).
    `prepared`: by a warm process before the round, else everything is built here."""
    try:
        WorkerRunner(spec, TorchWorld(spec, prepared), commit_target_s=commit_target_s, sinks=sinks,
                     progress=progress).run()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
