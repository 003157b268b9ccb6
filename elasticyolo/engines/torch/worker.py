"""A torch elastic training worker: the shared training loop on a torch.distributed process group.

Started by torch's `LocalElasticAgent` (see `launcher.py`) through `lifeline` (dies with its
agent). torch elastic restarts the whole world on every membership change, so each start is a
resume:

1. init the process group (gloo on CPU, NCCL on GPU) from torch elastic's env;
2. pick the newest state in the world: every node's local snapshot (written at each commit by
   the node's local rank 0) and the checkpoint store's latest manifest (rank 0 reads it); the
   newest wins, a local one on ties (no download). Ranks whose node holds that snapshot load it
   from disk; if some rank lacks it (a new node, a node that missed the last commit), the source
   rank broadcasts it. Nothing anywhere -> every rank starts from the same seeded init;
3. `core.set_world(world, rank)` applies the rescaling policy (LR ramp from the saved progress);
4. train; a commit = local snapshot (all nodes) + `CheckpointManager.maybe_save` (rank 0).

Gradients: the core calls `grad_allreduce(grads)` once per optimizer step; we flatten them into
one buffer and all-reduce it (sum / world = mean), which is DDP's math. Not the `DDP` wrapper
itself: the core owns accumulation, ranks with an empty last shard that skip forward/backward
(DDP would hang waiting for their buckets), AMP unscale after the reduce and clipping; DDP's
only extra, overlapping bucket reduces with backward, buys little for a 3-25 M parameter model.
"""

from __future__ import annotations

import io
import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import elasticyolo.train  # noqa: F401  (offline Ultralytics before anything imports it)
import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.train.digest import params_digest
from elasticyolo.train.core import TrainCore, quiet_ultralytics
from elasticyolo.train.loop import ProgressSink, Summary, TraceWriter, TrainingLoop
from elasticyolo.train.state import (
    build_core_checkpoint,
    core_state,
    load_core_checkpoint,
    load_core_state,
    read_state_file,
    state_step,
    write_state_file,
)

log = get_logger("elasticyolo.torch.worker")

SNAPSHOT_NAME = "state.pt"


# ---- gradients -------------------------------------------------------------------------------
def make_allreduce(world: int, fp16: bool = False) -> Callable[[list[torch.Tensor]], None]:
    """Average gradients in place across the world with one all-reduce on a flat buffer."""

    def allreduce(grads: list[torch.Tensor]) -> None:
        if world == 1 or not grads:
            return
        flat = _flatten_dense_tensors(grads)
        buf = flat.half() if fp16 and flat.is_cuda else flat
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)  # gloo has no AVG
        if buf is not flat:
            flat.copy_(buf)
        flat.div_(world)
        for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(r)

    return allreduce


# ---- node-local snapshots --------------------------------------------------------------------
class LocalSnapshots:
    """Writes `core_state` dicts to one file on this node, on a background thread.

    The training thread only copies tensors to CPU; pickling and the disk write happen here. A
    newer snapshot replaces one still waiting, so at most one write is queued. The thread is not
    a daemon: a worker that exits because a peer died still finishes the write in progress."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / SNAPSHOT_NAME
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._busy = False
        self._closed = False
        self.written_step = -1
        self._thread = threading.Thread(target=self._run, name="local-snapshot", daemon=False)
        self._thread.start()

    def submit(self, state: dict[str, Any]) -> None:
        with self._cond:
            self._pending = state
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                state, self._pending, self._busy = self._pending, None, True
            try:
                write_state_file(state, self.path)
                self.written_step = state_step(state)
            except Exception as exc:  # noqa: BLE001 - a failed snapshot must not stop training
                log.warning("local snapshot failed", path=str(self.path), error=str(exc))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5.0)

    def read(self) -> dict[str, Any] | None:
        return read_state_file(self.path)


# ---- commits ---------------------------------------------------------------------------------
class TorchHooks:
    """Commit = node-local snapshot (local rank 0 of every node) + store checkpoint (rank 0).

    Every rank commits at the same steps (the loop's contract): rank 0 picks the interval, about
    `target_s` of work unless the spec fixes `commit_every`, and broadcasts it."""

    def __init__(self, core: TrainCore, snapshots: LocalSnapshots | None, manager: Any = None,
                 target_s: float = 2.0) -> None:
        self.core, self.snapshots, self.manager, self.target_s = core, snapshots, manager, target_s
        self._fixed = core.spec.commit_every
        self._t_last = time.perf_counter()
        self._step_last = core.progress.step

    def commit(self) -> None:
        core = self.core
        if self.snapshots is not None:
            self.snapshots.submit(core_state(core))
        if self.manager is not None:
            p = core.progress
            self.manager.maybe_save(p.step, p.epoch, lambda: build_core_checkpoint(core),
                                    epoch_end=p.consumed == 0 and p.epoch > 0)

    def gather(self, obj: Any) -> list[Any]:
        if self.core.world == 1:
            return [obj]
        out: list[Any] = [None] * self.core.world
        dist.all_gather_object(out, obj)
        return out

    def commit_every(self, core: TrainCore) -> int:
        if self._fixed:
            return self._fixed
        now, step = time.perf_counter(), core.progress.step
        done = step - self._step_last
        per_step = (now - self._t_last) / done if done > 0 else 0.0
        self._t_last, self._step_last = now, step
        n = max(1, round(self.target_s / per_step)) if per_step > 0 else 1
        return int(broadcast_object(n, core))


def broadcast_object(obj: Any, core: TrainCore, src: int = 0) -> Any:
    if core.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, device=core.device if core.device.type == "cuda" else None)
    return box[0]


# ---- restore ---------------------------------------------------------------------------------
@dataclass
class Restored:
    source: str  # local | peer | store | fresh
    step: int
    src_rank: int = -1


def _broadcast_state(core: TrainCore, state: dict[str, Any] | None, src: int) -> dict[str, Any]:
    """Send `state` (on `src`) to every rank as one byte tensor."""
    dev = core.device if dist.get_backend() == "nccl" else torch.device("cpu")
    if core.rank == src:
        buf = io.BytesIO()
        torch.save(state, buf)
        data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=dev)
    dist.broadcast(size, src)
    payload = data.to(dev) if core.rank == src else torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
    dist.broadcast(payload, src)
    if core.rank == src:
        assert state is not None
        return state
    return torch.load(io.BytesIO(payload.cpu().numpy().tobytes()), map_location="cpu", weights_only=False)


def restore_newest(core: TrainCore, snapshots: LocalSnapshots | None, manager: Any, job: str) -> Restored:
    """Load the newest state anywhere in the world into `core` (see the module docstring)."""
    local = snapshots.read() if snapshots is not None else None
    local_step = state_step(local) if local is not None else -1
    store_step = -1
    if core.rank == 0 and manager is not None:
        from elasticyolo.checkpoint import read_latest

        try:
            latest = read_latest(manager.store, job)
            store_step = latest.step if latest is not None else -1
        except Exception as exc:  # noqa: BLE001 - an unreachable store must not block a local resume
            log.warning("checkpoint store unreadable; using local state only", error=str(exc))
    if core.world > 1:
        gathered: list[Any] = [None] * core.world
        dist.all_gather_object(gathered, (local_step, store_step))
    else:
        gathered = [(local_step, store_step)]
    steps = [int(g[0]) for g in gathered]
    store_step = int(gathered[0][1])
    best_local = max(steps)
    if best_local < 0 and store_step < 0:
        return Restored("fresh", 0)

    if best_local >= store_step:
        src = steps.index(best_local)
        if all(s == best_local for s in steps):
            assert local is not None
            load_core_state(core, local)
            return Restored("local", best_local, src)
        state = _broadcast_state(core, local if core.rank == src else None, src)
        load_core_state(core, state)
        return Restored("local" if steps[core.rank] == best_local else "peer", best_local, src)

    # The store is ahead of every node (all nodes are new, or snapshots were lost): rank 0
    # downloads, verifies and loads the checkpoint, then hands the lean state to the others.
    state: dict[str, Any] | None = None
    if core.rank == 0:
        from elasticyolo.checkpoint import restore_latest

        got = restore_latest(manager.store, job)
        if got is not None:
            load_core_checkpoint(core, got[0])
            manager.note_restored(got[1])
            state = core_state(core)
    if core.world > 1:
        state = _broadcast_state(core, state if core.rank == 0 else None, 0) if broadcast_object(
            state is not None, core) else None
        if state is not None and core.rank != 0:
            load_core_state(core, state)
    if state is None:
        return Restored("fresh", 0)
    return Restored("store", core.progress.step, 0)


# ---- entry point -----------------------------------------------------------------------------
def init_process_group(spec: TrainSpec) -> None:
    backend = "nccl" if torch.cuda.is_available() and spec.device not in ("cpu",) else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=timedelta(seconds=spec.gloo_timeout_s))


def run_worker(spec: TrainSpec, job: str, snapshot_dir: str | None, sinks: list[ProgressSink] | None = None
               ) -> Summary:
    quiet_ultralytics()
    t_start = time.time()
    init_process_group(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    work_dir = Path(snapshot_dir or "runs/elasticyolo") / "run"
    core = TrainCore(spec, rank=rank, world=world, local_rank=local_rank,
                     grad_allreduce=make_allreduce(world, spec.fp16_allreduce), work_dir=work_dir)
    # Every local rank reads the node's snapshot; only local rank 0 writes it (ranks hold equal state).
    snapshots = LocalSnapshots(snapshot_dir) if snapshot_dir else None
    manager = None
    if spec.checkpoint:
        from elasticyolo.checkpoint import manager_for_spec

        manager = manager_for_spec(spec, job)
    trace = TraceWriter()
    try:
        restored = restore_newest(core, snapshots, manager, job)
        core.set_world(world, rank)
        trace.write("resume", rank=rank, world=world, step=core.progress.step, epoch=core.progress.epoch,
                    consumed=core.progress.consumed, source=restored.source, src_rank=restored.src_rank,
                    lr_scale=core.current_lr_scale(), accumulate=core.scaling.accumulate,
                    node=os.environ.get("ELASTICYOLO_NODE_ID"), local_rank=local_rank,
                    restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
                    params_digest=params_digest(core.model), proc_start=_proc_start(), run_start=t_start)
        log.info("training", rank=rank, world=world, epoch=core.progress.epoch, step=core.progress.step,
                 source=restored.source)
        hooks = TorchHooks(core, snapshots if local_rank == 0 else None, manager if rank == 0 else None)
        loop = TrainingLoop(core, hooks=hooks, sinks=sinks if rank == 0 else [], trace=trace)
        summary = loop.run()
        if manager is not None and rank == 0:
            manager.save(core.progress.step, core.progress.epoch, lambda: build_core_checkpoint(core),
                         reason="final", wait=True, timeout=120)
        trace.write("done", rank=rank, world=world, step=core.progress.step)
        if rank == 0:
            m = summary.metrics
            print(f"done: epochs={summary.epochs} steps={summary.steps} world={world} "
                  f"mAP50={m.get('mAP50', 0.0):.3f} mAP50-95={m.get('mAP50-95', 0.0):.3f} "
                  f"seconds={summary.seconds:.1f}", flush=True)
        return summary
    finally:
        core.close()
        if snapshots is not None:
            snapshots.close()
        if manager is not None:
            manager.close(timeout=30)


def _proc_start() -> float | None:
    """When this process was created (unix seconds), to split recovery time into phases."""
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - diagnostics only
        return None


def main() -> None:
    spec = TrainSpec.from_json(os.environ["ELASTICYOLO_SPEC"], "ELASTICYOLO_SPEC")
    job = os.environ.get("ELASTICYOLO_JOB", "default")
    run_worker(spec, job, os.environ.get("ELASTICYOLO_SNAPSHOT_DIR") or None)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
