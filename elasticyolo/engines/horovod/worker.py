"""A Horovod Elastic training worker: `hvd.elastic.run` around the shared training loop.

State kept by `hvd.elastic.TorchState`: optimizer, model, EMA model (tensors broadcast from rank
0 on sync) and a progress record (epoch, consumed samples, step, LR-ramp state), the AMP scaler
and EMA update count (plain objects). A commit copies them to host memory; a failed collective
rolls every survivor back to the last commit, and the sampler resumes from that record, so no
sample of an epoch is trained twice or skipped (counting committed work only). A commit is
`worker_runtime/commit.py`'s, with `HorovodCommit` as the engine's part; the rest of the worker is
`worker_runtime/runner.py`'s, with `HorovodWorld` as the engine's part.
"""

from __future__ import annotations

import os
import time
from functools import partial
from dataclasses import asdict, dataclass
from typing import Any

import elasticyolo.train  # noqa: F401  (offline Ultralytics before anything imports it)
import horovod.torch as hvd
import torch
from horovod.common.elastic import ObjectState, run_fn
from horovod.common.exceptions import HostsUpdatedInterrupt
from horovod.runner.elastic.worker import HostUpdateResult

from elasticyolo.engines.horovod.abort import ABORT, abort_horovod_collectives, horovod_aborter
from elasticyolo.engines.horovod.quiesce import QuiesceInterrupt, QuiescePoller, hold_until_stopped
from elasticyolo.engines.horovod.saved_state import buffered_handler
from elasticyolo.engines.horovod.state_sync import send_shards
from elasticyolo.train.state_shares import apply_plain, prime_optimizer_state, signature, state_tensors
from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.train.checkpointing import open_checked_store
from elasticyolo.train.core import Progress, TrainCore, shared_progress
from elasticyolo.train.digest import optimizer_state_digest, params_digest
from elasticyolo.train.layout import default_layout
from elasticyolo.train.loop import ProgressSink, Summary
from elasticyolo.train.sim_accelerator import HOROVOD_THREAD, name_threads_started
from elasticyolo.train.snapshots import restore_newest
from elasticyolo.worker_runtime.commit import EngineCommit
from elasticyolo.worker_runtime.progress import EtcdProgress
from elasticyolo.worker_runtime.runner import WorkerRunner, WorkerWorld

SNAPSHOT_PERIOD_S = 10.0  # node-local snapshots (for a leader loss) at most this often
WAIT_POLL_S = 0.0005  # how often a rank waiting for its gradients' all-reduce looks

log = get_logger("elasticyolo.worker")


def wait_quietly(handle: int) -> Any:
    """`hvd.synchronize(handle)` without its busy wait: Horovod 0.28 waits for a collective in a
    `sched_yield` loop, so the waiting training thread stays runnable and takes CPU from the
    background thread that does the all-reduce (on a CPU-quota'd node, measured: every rank at
    its quota while the world waited on the slowest). Polling with short sleeps leaves the CPU to
    it; the result or the error (a failed collective raises here as before) is the same."""
    while not hvd.poll(handle):
        time.sleep(WAIT_POLL_S)
    return hvd.synchronize(handle)


class AlwaysSyncTorchState(hvd.elastic.TorchState):
    """Every hosts-updated reset re-syncs state from rank 0.

    Stock Horovod skips `sync()` when hosts were only removed; if a spare host is promoted in the
    same reset, the newcomer calls `sync()` (a broadcast) while survivors don't, and the job
    deadlocks (Horovod issue #3494). Syncing on every reset costs one broadcast and removes that.
    """

    quiesce_poller: QuiescePoller | None = None
    on_quiesce: Any = None  # called on every rank at the commit all ranks agreed to quiesce at
    aborter = horovod_aborter()  # one worker process, one state
    model_ema: Any = None  # the ModelEMA updating `ema` from `net` (a layout change must reach it)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # Rollback copies that training after a restore cannot write into, saved into reused
        # buffers (saved_state.py).
        self._handlers = {name: buffered_handler(h.value) or h for name, h in self._handlers.items()}

    def on_hosts_updated(self, timestamp: int, update_res: int) -> None:
        # The driver lost a node of this world (engines/horovod/abort.py): fail the collective now
        # instead of at Gloo's timeout. Not a host update of its own: the reset follows.
        if int(update_res) & ABORT:
            n = self.aborter.abort()
            if n is None:
                log.info("abort ignored: this rank has left that world already")
            else:
                log.info("collective aborted: a node of the world was lost", connections=n)
            return
        super().on_hosts_updated(timestamp, update_res)

    def sync(self) -> None:
        # After a failure every survivor restored its own last commit; when all ranks hold the
        # same one (the usual case: a newcomer or a rank a commit behind differs) the broadcast
        # of model, optimizer and EMA from rank 0 changes nothing: skip it (measured: 0.25 s of
        # yolov8n on 2 CPU ranks), and hand out only rank 0's plain objects, whose rank-local
        # fields differ (core.RANK_LOCAL_PROGRESS). Otherwise, when the tensors line up on every
        # rank, the ranks that hold rank 0's state send it to the others only, in shares
        # (state_sync.send_shards): on a join the survivors copy nothing.
        if hvd.size() == 1:
            return
        t0 = time.perf_counter()
        tensors, plain = state_tensors([self.net, self.ema], self.opt)
        mine = (shared_progress(self.progress), self.ema_updates, params_digest(self.net),
                optimizer_state_digest(self.opt.state_dict()), signature(tensors))
        everyone = hvd.allgather_object(mine, name="sync.same")
        t_agreed = time.perf_counter()
        if all(other == mine for other in everyone):
            ObjectState.sync(self)  # progress (its rank-local fields), AMP scaler, EMA update count
            log.info("state already identical on every rank; tensors not broadcast", step=self.progress.get("step"),
                     seconds=round(time.perf_counter() - t0, 3))
            return
        if all(other[-1] == mine[-1] for other in everyone):
            senders = [r for r, other in enumerate(everyone) if other == everyone[0]]
            receivers = [r for r, other in enumerate(everyone) if other != everyone[0]]
            send_shards(tensors, senders, receivers)
            # One broadcast for the optimizer's plain values and ObjectState's (progress, AMP
            # scaler, EMA update count): what ObjectState.sync() broadcasts, in the same call.
            plain, saved = hvd.broadcast_object((plain, self._saved_state), root_rank=0, name="sync.plain")
            apply_plain(self.opt, plain)
            self._saved_state = saved
            self._set_attrs()
            how = f"shares from {len(senders)} ranks to ranks {receivers}"
        else:
            with default_layout([self.net, self.ema], self.opt, self.model_ema):  # Horovod's broadcasts: NCHW only
                super().sync()
            how = "tensor by tensor"
        log.info("state synced from rank 0", how=how, tensors=len(tensors), step=self.progress.get("step"),
                 seconds=round(time.perf_counter() - t0, 3), agreed_s=round(t_agreed - t0, 3))

    def restore(self) -> None:
        # Our collective failed: stop the peers that still wait on us at once, before the reset
        # blocks in the rendezvous (our sockets would otherwise stay open until Gloo's timeout).
        abort_horovod_collectives()
        self.aborter.left()  # the connections made from now on are the next world's
        super().restore()

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


class HorovodCollectives:
    """`train.collectives.Collectives` over Horovod (the current world)."""

    @property
    def rank(self) -> int:
        return int(hvd.rank())

    @property
    def size(self) -> int:
        return int(hvd.size())

    def allgather_object(self, obj: Any) -> list[Any]:
        return list(hvd.allgather_object(obj, name="allgather_object"))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src, name="broadcast_object")

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        return bytes(hvd.broadcast_object(data, root_rank=src, name="broadcast_bytes"))


class HorovodCommit(EngineCommit):
    """Horovod's part of a commit (`worker_runtime/commit.py`): `state.commit()` is save() +
    check_host_updates(); the snapshot and the checkpoint go in between, so they hold exactly the
    committed state even when the check raises a hosts-updated reset."""

    def __init__(self, state: "AlwaysSyncTorchState", core: TrainCore) -> None:
        self.state, self.core = state, core

    def save(self) -> None:
        store_core_into_state(self.core, self.state)
        self.state.save()

    def check(self) -> None:
        self.state.check_host_updates()


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


@dataclass
class PreparedWorker:
    """What a worker builds before it has a world (a pre-warmed worker: before it is offered). A
    joiner gets its environment only once the running world has stopped at the reset for it, so
    everything here would otherwise be part of that world's pause."""

    core: TrainCore
    state: AlwaysSyncTorchState
    store: Any  # the spec's checkpoint store, checked (None without one)


def slot_from_env() -> tuple[int, int | None]:
    """(local rank, local size) of this process from Horovod's environment (the launcher sets it)."""
    size = os.environ.get("HOROVOD_LOCAL_SIZE", "")
    return int(os.environ.get("HOROVOD_LOCAL_RANK") or 0), int(size) if size.isdigit() else None


def prepare_worker(spec: TrainSpec, core: TrainCore | None = None) -> PreparedWorker:
    if core is None:
        local_rank, local_size = slot_from_env()
        core = TrainCore(spec, rank=0, world=1, local_rank=local_rank, local_size=local_size)
        core.warm_up()
    prime_optimizer_state(core.optimizer)
    # Names matter: handlers sync in keyword order, optimizer first (see prime_optimizer_state).
    state = AlwaysSyncTorchState(
        model=None, optimizer=None, opt=core.optimizer, net=core.model, ema=core.ema.ema,
        progress=asdict(core.progress), scaler=core.scaler.state_dict(), ema_updates=core.ema.updates,
    )
    state.model_ema = core.ema
    # Any node may come to hold rank 0, which writes the checkpoints: check writing everywhere.
    return PreparedWorker(core, state, open_checked_store(spec, write=True))


# A world that could not be set up (a peer did not publish its Gloo address in time: a slow
# joiner, a peer lost meanwhile) fails `hvd.init()` (scripts/build_horovod.sh catches the Gloo
# error in Horovod's background thread, where it aborted the process). The worker then exits with
# this code: the driver starts it again for the next world (engines/horovod/registry.py), and the
# round policy does not count it as a crash (round_policy.py). Exiting, not retrying in place:
# the failed world's peers must see this worker leave so that the driver forms the next one.
EXIT_WORLD_NOT_FORMED = 75  # EX_TEMPFAIL


def init_horovod() -> None:
    """`hvd.init()`, its threads (the background loop, gloo's transport) named, so that a simulated
    node runs them on the cluster's interconnect (`train/sim_accelerator.py`)."""
    try:
        with name_threads_started(HOROVOD_THREAD):
            hvd.init()
    except ValueError as exc:
        if "initialization failed" not in str(exc):
            raise
        log.warning("the world could not be set up; leaving it to be started again for the next one")
        raise SystemExit(EXIT_WORLD_NOT_FORMED) from None


class HorovodWorld(WorkerWorld):
    """Horovod's part of a worker (`worker_runtime/runner.py`): `hvd.init()`, its collectives, a
    commit that is `state.commit()`, and its world changes: `hvd.elastic.run` rolls every survivor
    back to the last commit on a failure and re-syncs from rank 0 on every reset; a quiesce holds
    the worker at an agreed commit; a slot removed from the job exits."""

    snapshot_period_s = SNAPSHOT_PERIOD_S

    def __init__(self, spec: TrainSpec, prepared: PreparedWorker | None, progress: EtcdProgress | None) -> None:
        self.spec, self.prepared, self.progress = spec, prepared, progress
        self._collectives = HorovodCollectives()

    @property
    def collectives(self) -> HorovodCollectives:
        return self._collectives

    @property
    def local_rank(self) -> int:
        return int(hvd.local_rank())

    def join(self, runner: WorkerRunner) -> TrainCore:
        if self.prepared is None:
            self.prepared = prepare_worker(self.spec)
        runner.store = self.prepared.store
        core = self.prepared.core
        init_horovod()
        compression = hvd.Compression.fp16 if self.spec.fp16_allreduce else hvd.Compression.none

        def allreduce(grads: list[torch.Tensor]) -> None:
            if hvd.size() == 1:
                return
            # Horovod takes only tensors contiguous in NCHW; NHWC gradients (layout.py) travel as copies.
            compressed, ctxs = zip(*(compression.compress(g.contiguous()) for g in grads))
            reduced = wait_quietly(hvd.grouped_allreduce_async(list(compressed), op=hvd.Average, name="grads"))
            for g, r, ctx in zip(grads, reduced, ctxs):
                g.copy_(compression.decompress(r, ctx))

        core.grad_allreduce = allreduce
        core.progress.world = 0  # built for world 1: the first set_world is not a resize
        core.set_world(hvd.size(), hvd.rank())
        return core

    def run(self, runner: WorkerRunner) -> Summary | None:
        assert self.prepared is not None
        core, state, env = runner.core, self.prepared.state, runner.env
        snapshots, checkpointer, trace, progress = runner.snapshots, runner.checkpointer, runner.trace, self.progress
        if env.restore or hvd.rank() == 0:
            if env.restore:
                # A freshly started world (e.g. after leader loss): the newest snapshot or checkpoint.
                restore_newest(core, snapshots, self.collectives, checkpointer)
            else:
                # A fresh process holding rank 0 is a cold start (Horovod keeps rank 0 on the oldest
                # surviving host): the newest checkpoint, handed to every rank by the first sync.
                checkpointer.restore_into(core)
            prime_optimizer_state(core.optimizer)
            store_core_into_state(core, state)
            state.save()  # what was restored is the first rollback point

        def on_reset() -> None:
            state.aborter.joined()
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
            trace.write("quiesce", rank=core.rank, world=core.world, step=core.progress.step,
                        hold=bool(request.get("hold")), checkpoint=ok, seconds=round(time.perf_counter() - t0, 3))
            log.info("quiesced", step=core.progress.step, checkpoint=ok, by=request.get("by"))

        state.quiesce_poller, state.on_quiesce = poller, on_quiesce
        first_entry = [True]

        def reset_world() -> None:
            # Horovod's reset (`hvd.elastic.run`'s), marking the rank as between worlds until
            # `on_reset`: an abort meant for the world it left must not cut its rendezvous (abort.py).
            state.aborter.left()
            hvd.shutdown()
            init_horovod()

        @partial(run_fn, reset=reset_world)
        def train(state: AlwaysSyncTorchState) -> Summary:
            before = core.progress.step  # steps this process reached (committed or not)
            load_core_from_state(core, state)
            core.set_world(hvd.size(), hvd.rank())
            if hvd.rank() == 0:
                report_resume(before, first_entry[0])
            first_entry[0] = False
            return runner.session(HorovodCommit(state, core), resume={
                # Digests cost a pass over every tensor: only for a trace (tests, benches).
                **({"optimizer_digest": optimizer_state_digest(core.optimizer.state_dict())} if trace.enabled
                   else {})})

        def report_resume(before: int, first: bool) -> None:
            # Lost steps: work this rank had done past the state the world resumes from (a rollback);
            # a restored world compares with the step its predecessor acknowledged when it quiesced.
            step, lost, reason = core.progress.step, max(0, before - core.progress.step), "reset"
            if first:
                reason, lost = "start", None
                if env.restore:
                    ack = poller.last_ack()
                    reason = "restore"
                    lost = max(0, int(ack["step"]) - step) if ack and ack.get("step") is not None else None
            if progress is not None:
                progress.resume(step, hvd.size(), lost, reason)

        try:
            return train(state)
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
            raise SystemExit(3) from None


def run_worker(spec: TrainSpec, *, commit_target_s: float, sinks: list[ProgressSink] | None = None,
               prepared: PreparedWorker | None = None, progress: EtcdProgress | None = None) -> Summary | None:
    """`prepared`: by a pre-warmed worker (prewarm.py), else built here, before `hvd.init()`.
    `progress`: the etcd sink (also among `sinks`), which takes the resume records.
    `commit_target_s`: seconds of work between commits (the engine's, `engine.py`)."""
    return WorkerRunner(spec, HorovodWorld(spec, prepared, progress), commit_target_s=commit_target_s, sinks=sinks,
                        progress=progress).run()
