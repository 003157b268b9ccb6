"""A Horovod Elastic training worker: `hvd.elastic.run` around the shared training loop.

State kept by `hvd.elastic.TorchState`: optimizer, model, EMA model (tensors broadcast from rank
0 on sync) and a progress record (epoch, consumed samples, step, LR-ramp state), the AMP scaler
and EMA update count (plain objects). A commit copies them to host memory; a failed collective
rolls every survivor back to the last commit, and the sampler resumes from that record, so no
sample of an epoch is trained twice or skipped (counting committed work only).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from typing import Any

import elasticyolo.train  # noqa: F401  (offline Ultralytics before anything imports it)
import horovod.torch as hvd
import torch
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult

from elasticyolo.engines.horovod.quiesce import QuiesceInterrupt, QuiescePoller, hold_until_stopped

from elasticyolo.train.snapshots import LocalSnapshots, restore_newest, snapshot_dir
from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.train.checkpointing import Checkpointer, job_name
from elasticyolo.train.digest import optimizer_state_digest, params_digest
from elasticyolo.train.core import Progress, TrainCore, quiet_ultralytics
from elasticyolo.train.loop import ProgressSink, Summary, TraceWriter, TrainingLoop

log = get_logger("elasticyolo.worker")


class AlwaysSyncTorchState(hvd.elastic.TorchState):
    """Every hosts-updated reset re-syncs state from rank 0.

    Stock Horovod skips `sync()` when hosts were only removed; if a spare host is promoted in the
    same reset, the newcomer calls `sync()` (a broadcast) while survivors don't, and the job
    deadlocks (Horovod issue #3494). Syncing on every reset costs one broadcast and removes that.
    """

    quiesce_poller: QuiescePoller | None = None
    on_quiesce: Any = None  # called on every rank at the commit all ranks agreed to quiesce at

    def check_host_updates(self) -> None:
        # Horovod's own check, plus rank 0's pending quiesce request (drain.py) in the same
        # broadcast, so every rank quiesces at the same commit.
        prev = last = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, res = self._host_messages.get()
            if timestamp > last:
                last, update = timestamp, update | res
        poller = self.quiesce_poller
        request = poller.pending() if poller is not None and hvd.rank() == 0 else None
        prev, self._last_updated_timestamp, update, request = self._bcast_object((prev, last, update, request))
        if request is not None and self.on_quiesce is not None:
            if poller is not None:
                poller.handled.add(request["id"])
            self.on_quiesce(request)
            if request.get("hold"):
                raise QuiesceInterrupt(request)
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(False)


def prime_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state with a zero-LR step.

    Horovod's optimizer-state broadcast runs a real `optimizer.step()` on any rank whose state is
    empty (a fresh worker joining), which would apply weight decay to its parameters; with state
    already present it only broadcasts.
    """
    if optimizer.state_dict()["state"]:
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)


class HorovodHooks:
    """Commits through the elastic state; picks the commit interval (~1 s of work) on rank 0."""

    def __init__(self, state: "AlwaysSyncTorchState", core: TrainCore, target_s: float = 1.0,
                 snapshots: LocalSnapshots | None = None, checkpointer: Checkpointer | None = None) -> None:
        self.state, self.core, self.target_s = state, core, target_s
        self.snapshots = snapshots
        self.checkpointer = checkpointer
        self._fixed = core.spec.commit_every
        self._t_last = time.perf_counter()
        self._step_last = core.progress.step

    def commit(self) -> None:
        store_core_into_state(self.core, self.state)
        if self.snapshots is not None:
            # Before state.commit(): it saves, then may raise to reset; the core is the commit.
            self.snapshots.maybe_save(self.core)
        # state.commit() is save() + check_host_updates(); the checkpoint goes in between so it
        # holds exactly the committed state even when the check raises a hosts-updated reset.
        self.state.save()
        if self.checkpointer is not None:
            self.checkpointer.after_commit(self.core)
        self.state.check_host_updates()

    def gather(self, obj: Any) -> list[Any]:
        return list(hvd.allgather_object(obj, name="val_stats"))

    def commit_every(self, core: TrainCore) -> int:
        if self._fixed:
            return self._fixed
        now, step = time.perf_counter(), core.progress.step
        per_step = (now - self._t_last) / max(step - self._step_last, 1)
        self._t_last, self._step_last = now, step
        n = max(1, round(self.target_s / per_step)) if step > 0 else 1
        # Every rank must commit at the same steps: rank 0 decides.
        return int(hvd.broadcast_object(n, root_rank=0, name="commit_every"))


def store_core_into_state(core: TrainCore, state: Any) -> None:
    # Fresh objects every time: ObjectState.save() keeps references, not copies.
    state.progress = asdict(core.progress)
    state.scaler = core.scaler.state_dict()
    state.ema_updates = core.ema.updates


def load_core_from_state(core: TrainCore, state: Any) -> None:
    core.progress = Progress(**state.progress)
    core.ema.updates = state.ema_updates
    if state.scaler:
        core.scaler.load_state_dict(state.scaler)
    core.sync_sampler_from_progress()


def run_worker(spec: TrainSpec, sinks: list[ProgressSink] | None = None,
               core: TrainCore | None = None) -> Summary | None:
    """`core`: built before `hvd.init()` by a pre-warmed worker (prewarm.py), else built here."""
    quiet_ultralytics()
    hvd.init()
    compression = hvd.Compression.fp16 if spec.fp16_allreduce else hvd.Compression.none

    def allreduce(grads: list[torch.Tensor]) -> None:
        if hvd.size() == 1:
            return
        reduced = hvd.grouped_allreduce(grads, op=hvd.Average, compression=compression, name="grads")
        for g, r in zip(grads, reduced):
            g.copy_(r)

    if core is None:
        core = TrainCore(spec, rank=hvd.rank(), world=hvd.size(), local_rank=hvd.local_rank(), grad_allreduce=allreduce)
    else:
        core.grad_allreduce = allreduce
        core.progress.world = 0  # built for world 1: the first set_world is not a resize
        core.set_world(hvd.size(), hvd.rank())
    snapshots = LocalSnapshots(snapshot_dir(), hvd.local_rank())
    checkpointer = Checkpointer(spec, job_name(), hvd.rank(), sinks=sinks if hvd.rank() == 0 else None)
    restored_step = None
    if os.environ.get("ELASTICYOLO_RESTORE") == "1":
        # A freshly started world (e.g. after leader loss): resume from the newest snapshot.
        restored_step = restore_newest(core, snapshots)
    if hvd.rank() == 0:
        # A fresh process holding rank 0 is a cold start (Horovod keeps rank 0 on the oldest
        # surviving host): the newest checkpoint wins if it is newer than any local snapshot, and
        # the first sync hands it to every rank.
        checkpointer.restore_into(core, newer_than=-1 if restored_step is None else restored_step)
    prime_optimizer_state(core.optimizer)
    trace = TraceWriter()
    # Names matter: handlers sync in keyword order, optimizer first (see prime_optimizer_state).
    state = AlwaysSyncTorchState(
        model=None, optimizer=None, opt=core.optimizer, net=core.model, ema=core.ema.ema,
        progress=asdict(core.progress), scaler=core.scaler.state_dict(), ema_updates=core.ema.updates,
    )

    def on_reset() -> None:
        trace.write("reset", rank=hvd.rank(), world=hvd.size())
        log.info("reset", rank=hvd.rank(), world=hvd.size())

    state.register_reset_callbacks([on_reset])
    poller = QuiescePoller()

    def on_quiesce(request: dict[str, Any]) -> None:
        """At an agreed commit: snapshot everywhere, checkpoint if asked, then rank 0 acks."""
        t0 = time.perf_counter()
        snapshots.save_now(core)
        ok: bool | None = None
        if request.get("checkpoint") and checkpointer.enabled:
            ok = checkpointer.save_now(core, reason="drain", timeout=float(request.get("timeout_s") or 30))
        hvd.allreduce(torch.zeros(1), name=f"quiesce.{request['id']}")  # every node's snapshot is on disk
        if core.rank == 0:
            poller.ack(request, core.progress.step, core.progress.epoch, ok)
        trace.write("quiesce", rank=core.rank, world=core.world, step=core.progress.step, hold=bool(request.get("hold")),
                    checkpoint=ok, seconds=round(time.perf_counter() - t0, 3))
        log.info("quiesced", step=core.progress.step, checkpoint=ok, by=request.get("by"))

    state.quiesce_poller, state.on_quiesce = poller, on_quiesce
    first_entry = [True]

    @hvd.elastic.run
    def train(state: AlwaysSyncTorchState) -> Summary:
        before = core.progress.step  # steps this process reached (committed or not)
        load_core_from_state(core, state)
        core.set_world(hvd.size(), hvd.rank())
        if hvd.rank() == 0:
            report_resume(before, first_entry[0])
        first_entry[0] = False
        trace.write("resume", rank=core.rank, world=core.world, step=core.progress.step,
                    epoch=core.progress.epoch, consumed=core.progress.consumed, lr_scale=core.current_lr_scale(),
                    accumulate=core.scaling.accumulate, params_digest=params_digest(core.model),
                    optimizer_digest=optimizer_state_digest(core.optimizer.state_dict()))
        log.info("training", rank=core.rank, world=core.world, epoch=core.progress.epoch, step=core.progress.step)
        checkpointer.rank = core.rank
        checkpointer.sinks = list(sinks or []) if core.rank == 0 else []
        hooks = HorovodHooks(state, core, snapshots=snapshots, checkpointer=checkpointer)
        loop = TrainingLoop(core, hooks=hooks, sinks=sinks if core.rank == 0 else [], trace=trace)
        return loop.run()

    def report_resume(before: int, first: bool) -> None:
        # Lost steps: work this rank had done past the state the world resumes from (a rollback);
        # a restored world compares with the step its predecessor acknowledged when it quiesced.
        step, lost, reason = core.progress.step, max(0, before - core.progress.step), "reset"
        if first:
            reason, lost = "start", None
            if os.environ.get("ELASTICYOLO_RESTORE") == "1":
                ack = poller.last_ack()
                reason = "restore"
                lost = max(0, int(ack["step"]) - step) if ack and ack.get("step") is not None else None
        poller.report_resume(step, hvd.size(), lost, reason)

    try:
        summary = train(state)
    except QuiesceInterrupt as q:
        trace.write("held", rank=hvd.rank(), step=core.progress.step)
        log.info("quiesced for a handover; waiting to be stopped", by=q.request.get("by"), step=core.progress.step)
        checkpointer.close()
        hold_until_stopped()
        return None
    except ValueError as exc:
        if "initialization failed" not in str(exc):
            raise
        # The driver gave this slot rank -1: its host left the job (a drain) after the world re-formed.
        trace.write("left", step=core.progress.step)
        log.info("removed from the elastic job; exiting", step=core.progress.step)
        checkpointer.close()
        raise SystemExit(3) from None
    if not checkpointer.save_now(core, reason="final"):
        log.warning("final_checkpoint_late", step=core.progress.step)
    checkpointer.close()
    trace.write("done", rank=hvd.rank(), world=hvd.size(), step=core.progress.step)
    if hvd.rank() == 0:
        m = summary.metrics
        print(f"done: epochs={summary.epochs} steps={summary.steps} world={hvd.size()} "
              f"mAP50={m.get('mAP50', 0.0):.3f} mAP50-95={m.get('mAP50-95', 0.0):.3f} "
              f"seconds={summary.seconds:.1f}", flush=True)
    return summary


def main_from_env() -> None:  # pragma: no cover - used through `elasticyolo worker`
    spec = TrainSpec.from_json(os.environ["ELASTICYOLO_SPEC"], "ELASTICYOLO_SPEC")
    run_worker(spec)
