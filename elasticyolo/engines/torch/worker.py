"""A torch elastic training worker: the shared training loop on a torch.distributed process group.

Started by torch's `LocalElasticAgent` (see `launcher.py`) as `elasticyolo worker` (dies with
its launcher), or handed the round's environment as a warm process (`warm.py`). torch elastic
restarts the whole world on every membership change, so each start is a resume:

1. init the process group (gloo on CPU, NCCL on GPU) from torch elastic's env;
2. the newest state in the world: every node's local snapshot and the checkpoint store's latest
   (`train/snapshots.py` `restore_newest`, over `TorchCollectives`);
3. `core.set_world(world, rank)` applies the rescaling policy (LR ramp from the saved progress);
4. train; a commit (`engines/commit.py`) = local snapshot (local rank 0 of every node, every
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
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import elasticyolo.train  # noqa: F401  (offline Ultralytics before anything imports it)
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from elasticyolo.engines.commit import CommitHooks
from elasticyolo.engines.torch.stop_at_commit import StopAtCommit, torch_reduce
from elasticyolo.errors import UserError
from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.train.checkpointing import Checkpointer, open_checked_store
from elasticyolo.train.core import TrainCore, quiet_ultralytics
from elasticyolo.train.digest import params_digest
from elasticyolo.train.loop import ProgressSink, Summary, TraceWriter, TrainingLoop
from elasticyolo.train.run_publish import ClusterRunFolder
from elasticyolo.train.snapshots import LocalSnapshots, finish_snapshot_on_sigterm, restore_newest
from elasticyolo.worker_runtime import worker_env, worker_errors
from elasticyolo.worker_runtime.progress import EtcdProgress

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


def run_worker(spec: TrainSpec, job: str, snapshot_dir: str | os.PathLike[str] | None,
               sinks: list[ProgressSink] | None = None, progress: EtcdProgress | None = None,
               commit_target_s: float = 2.0, prepared: PreparedWorker | None = None) -> Summary:
    """`prepared`: by a warm process before the round, else everything is built here."""
    quiet_ultralytics()
    t_start = time.time()
    init_process_group(spec)
    env = worker_env.read()
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    work_dir = env.run_dir
    core = prepared.core if prepared is not None else None
    if core is None:
        core = TrainCore(spec, rank=rank, world=world, local_rank=local_rank, work_dir=work_dir)
    else:
        core.progress.world = 0  # built for world 1: the first set_world is not a resize
        core.set_world(world, rank)
    collectives = TorchCollectives(core.device)
    # Every local rank reads the node's snapshot; only local rank 0 writes it (ranks hold equal state).
    snapshots = LocalSnapshots(snapshot_dir, writer=local_rank == 0,
                               period_s=env.snapshot_period(SNAPSHOT_PERIOD_S)) if snapshot_dir else None
    stop = None
    if snapshots is not None:
        stop = StopAtCommit(core, torch_reduce(core.device), snapshots, world=world)
        finish_snapshot_on_sigterm(snapshots, stop_at_commit=stop.request)
    core.grad_allreduce = make_allreduce(world, spec.fp16_allreduce, stop)  # before the first step
    checkpointer = Checkpointer(spec, job, rank, sinks=sinks if rank == 0 else None,
                                store=prepared.store if prepared is not None else None)
    trace = TraceWriter()
    try:
        restored = restore_newest(core, snapshots, collectives, checkpointer)
        core.set_world(world, rank)
        trace.write("resume", rank=rank, world=world, step=core.progress.step, epoch=core.progress.epoch,
                    consumed=core.progress.consumed, source=restored.source, src_rank=restored.src_rank,
                    lr_scale=core.current_lr_scale(), accumulate=core.scaling.accumulate,
                    node=env.node_id, local_rank=local_rank,
                    restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    proc_start=_proc_start(), run_start=t_start,
                    **({"params_digest": params_digest(core.model)} if trace.enabled else {}))
        log.info("training", rank=rank, world=world, epoch=core.progress.epoch, step=core.progress.step,
                 source=restored.source)
        if rank == 0 and progress is not None:
            progress.resume(core.progress.step, world, None, "restore" if restored.source != "fresh" else "start",
                            source=restored.source)
        hooks = CommitHooks(core, collectives, target_s=commit_target_s, snapshots=snapshots,
                            checkpointer=checkpointer, engine=stop)
        # Ultralytics' run folder on rank 0's node, published next to the checkpoints.
        run_folder = ClusterRunFolder(core, job, checkpointer.store, work_dir.parent)
        loop = TrainingLoop(core, hooks=hooks, sinks=(list(sinks or []) + run_folder.sinks()) if rank == 0 else [],
                            trace=trace)
        summary = loop.run()
        if not checkpointer.save_now(core, reason="final"):
            log.warning("final_checkpoint_late", step=core.progress.step)
        trace.write("done", rank=rank, world=world, step=core.progress.step)
        if rank == 0:
            run_folder.finish()
            m = summary.metrics
            print(f"done: epochs={summary.epochs} steps={summary.steps} world={world} "
                  f"mAP50={m.get('mAP50', 0.0):.3f} mAP50-95={m.get('mAP50-95', 0.0):.3f} "
                  f"seconds={summary.seconds:.1f}", flush=True)
        return summary
    finally:
        core.close()
        if snapshots is not None:
            snapshots.close()
        checkpointer.close(timeout=30)


def _proc_start() -> float | None:
    """When this process was created (unix seconds), to split recovery time into phases."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - diagnostics only
        return None


def main(spec: TrainSpec, sinks: list[ProgressSink] | None = None, progress: EtcdProgress | None = None,
         commit_target_s: float = 2.0, prepared: PreparedWorker | None = None) -> int:
    """The worker entry point (`elasticyolo worker` through the engine registry)."""
    env = worker_env.read()
    try:
        run_worker(spec, env.job or "default", env.snapshot_dir, sinks=sinks, progress=progress,
                   commit_target_s=commit_target_s, prepared=prepared)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0
