"""A torch engine training worker: the shared training loop on a process group that the survivors
re-form in place across world changes.

Started by its node's launcher (`launcher.py`), warm (`worker_runtime/prewarm.py`). One process
lives through every world it takes part in:

1. it joins the process-group store of its submission once, under a rank no other process of the
   job ever had (its incarnation), with torch's Gloo reconfiguration enabled (NCCL on a GPU), and
   publishes its member record with its reconfiguration handle (`world_watch.py`);
2. it waits for a world that lists it (the leader's `coordinator.py`), enters it with
   `dist._reconfigure` (the new communicator among exactly those handles: tens of ms), and the
   ranks agree on the state: every rank's last commit held in memory; the newest travels to any
   rank that has an older one or none (a joiner), and a world where nobody has one restores the
   newest snapshot or checkpoint (`runner.restore`: a fresh job, a full restart);
3. it trains (`worker_runtime/runner.py`) with `InPlaceCommit`: a commit keeps the state in memory
   as the rollback point, and the ranks agree on one integer: whether a newer world is out or a
   rank asked to leave. Every rank then leaves the world at that same commit: the survivors enter
   the next world with exactly the committed state, and the running world loses no step;
4. a failed collective (a peer died, or was aborted because the coordinator lost it: frozen
   node) rolls the survivors back to their last commit and they enter the next world; the work
   since that commit is redone once, so every sample of an epoch is trained once (counting
   committed work);
5. SIGTERM (its node drains or the job stops) asks to leave: the record says so, the coordinator
   publishes a world without it, and it exits at the next commit.

Gradients: one all-reduce of a flat buffer per optimizer step (DDP's math; see `make_allreduce`),
with one more element: a rank that has seen a newer world or asked to leave sets it, and that step
becomes a commit on every rank (`commit_now`), so a change waits one step, not a commit interval.
"""

from __future__ import annotations

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

from elasticyolo.engines.torch.launcher import EXIT_FINISHED_ELSEWHERE
from elasticyolo.engines.torch.rendezvous import EtcdStore
from elasticyolo.engines.torch.world_plan import World
from elasticyolo.engines.torch.world_watch import WorldSource, WorldWatch
from elasticyolo.errors import UserError
from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.train.checkpointing import open_checked_store
from elasticyolo.train.core import TrainCore
from elasticyolo.train.loop import ProgressSink, Summary
from elasticyolo.train.snapshots import finish_snapshot_on_sigterm, send_state
from elasticyolo.train.state import core_state, load_core_state, progress_dict, progress_from, roll_back, state_step
from elasticyolo.train.state_shares import apply_plain, prime_optimizer_state, send_shards, signature, state_tensors
from elasticyolo.worker_runtime import worker_errors
from elasticyolo.worker_runtime.collective_abort import CollectiveAborter
from elasticyolo.worker_runtime.commit import EngineCommit
from elasticyolo.worker_runtime.progress import EtcdProgress
from elasticyolo.worker_runtime.runner import WorkerRunner, WorkerWorld

log = get_logger("elasticyolo.torch.worker")

SNAPSHOT_PERIOD_S = 10.0  # node-local snapshots (a full restart's state) at most this often
ENTER_TIMEOUT_S = 60.0  # entering a world waits this long for its other members at most
LEAVE_WAIT_S = 2.5  # a rank asked to leave exits by itself after this long if no commit came
ENV_SLOT = "LOCAL_RANK"
ENV_SLOTS = "LOCAL_WORLD_SIZE"


class CollectiveFailed(Exception):
    """A collective of the current world failed (a peer is gone, or the world was aborted)."""


class WorldChanged(Exception):
    """The ranks agreed at a commit to leave this world (`leaving`: this rank leaves the job)."""

    def __init__(self, leaving: bool) -> None:
        super().__init__("world changed")
        self.leaving = leaving


def guarded(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except RuntimeError as exc:  # gloo/NCCL errors (DistBackendError is one)
        raise CollectiveFailed(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc


# ---- gradients -------------------------------------------------------------------------------
def make_allreduce(world: int, fp16: bool, flag: Callable[[], int],
                   on_flag: Callable[[int], None]) -> Callable[[list[torch.Tensor]], None]:
    """Average gradients in place across the world with one all-reduce on a flat buffer; the last
    element carries `flag()` of every rank (summed), handed to `on_flag`."""

    def allreduce(grads: list[torch.Tensor]) -> None:
        if world == 1 or not grads:
            on_flag(flag())
            return
        marker = torch.full((1,), float(flag()), dtype=grads[0].dtype, device=grads[0].device)
        flat = _flatten_dense_tensors(grads + [marker])
        buf = flat.half() if fp16 and flat.is_cuda else flat
        guarded(lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM))  # gloo has no AVG
        if buf is not flat:
            flat.copy_(buf)
        on_flag(int(flat[-1].item() > 0.5))
        flat.div_(world)
        for g, r in zip(grads, _unflatten_dense_tensors(flat[:-1], grads)):
            g.copy_(r)

    return allreduce


# ---- collectives -----------------------------------------------------------------------------
class TorchCollectives:
    """`train.collectives.Collectives` over the default process group; a failure raises
    `CollectiveFailed`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # NCCL needs CUDA tensors; gloo takes CPU ones
        self.rank, self.size = 0, 1

    def allgather_object(self, obj: Any) -> list[Any]:
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        guarded(lambda: dist.all_gather_object(out, obj))
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if self.size == 1:
            return obj
        box = [obj]
        guarded(lambda: dist.broadcast_object_list(box, src=src,
                                                   device=self.device if self.device.type == "cuda" else None))
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
        guarded(lambda: dist.broadcast(size, src))
        if self.rank != src:
            payload = torch.empty(int(size.item()), dtype=torch.uint8, device=dev)
        guarded(lambda: dist.broadcast(payload, src))
        return data if self.rank == src and data is not None else payload.cpu().numpy().tobytes()

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's `values` (the same length everywhere), in rank order: one collective."""
        if self.size == 1:
            return [list(values)]
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        mine = torch.tensor(values, dtype=torch.int64, device=dev)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        guarded(lambda: dist.all_gather(out, mine))
        return [[int(v) for v in t.tolist()] for t in out]

    def max_int(self, value: int) -> int:
        if self.size == 1:
            return value
        dev = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([value], dtype=torch.int64, device=dev)
        guarded(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX))
        return int(t.item())


def torch_alltoall(payload: torch.Tensor, splits: list[int], incoming: list[int], index: int) -> torch.Tensor:
    """`state_shares.AllToAll` over the default process group: one `all_to_all_single`, with the
    sizes every rank derives from the layout."""
    out = torch.empty(sum(incoming), dtype=torch.uint8, device=payload.device)
    guarded(lambda: dist.all_to_all_single(out, payload, incoming, splits))
    return out


# ---- the commit --------------------------------------------------------------------------------
class InPlaceCommit(EngineCommit):
    """Keeps the committed state in memory (the rollback point) and makes the ranks leave the
    world together at a commit when one of them saw a newer world or asked to leave."""

    def __init__(self, world: "TorchWorld", core: TrainCore) -> None:
        self.world, self.core = world, core
        self._change_seen = False  # a step's all-reduce carried a rank's flag: commit now

    def flag(self) -> int:
        return int(self.world.wants_change())

    def on_flag(self, value: int) -> None:
        self._change_seen = self._change_seen or bool(value)

    def commit_now(self) -> bool:
        return self._change_seen

    def save(self) -> None:
        self.world.saved = core_state(self.core, into=self.world.saved)  # the last commit's buffers reused

    def agree(self) -> None:
        # After the snapshot (a peer dying here costs no node its snapshot of this commit), before
        # rank 0's checkpoint (which would hold every peer at this collective for its copy). A
        # commit that the step's all-reduce forced is agreed already (every rank saw the flag).
        if not self._change_seen:
            self._change_seen = bool(self.world.collectives.max_int(self.flag()))

    def check(self) -> None:
        if self._change_seen:
            raise WorldChanged(self.world.leave_requested.is_set())


@dataclass
class PreparedWorker:
    """What a warm process (`worker_runtime/prewarm.py`) builds before it is handed its slot."""

    core: TrainCore
    store: Any  # the checkpoint store, opened and checked (None: the job has none)


def prepare_worker(spec: TrainSpec, core: TrainCore) -> PreparedWorker:
    # Its optimizer state exists before it joins a world (state_shares: the state arrives in place).
    prime_optimizer_state(core.optimizer)
    # Any node may come to hold rank 0, which writes the checkpoints: check writing everywhere.
    return PreparedWorker(core, open_checked_store(spec, write=True))


class TorchWorld(WorkerWorld):
    """The torch engine's part of a worker (`worker_runtime/runner.py`)."""

    snapshot_period_s = SNAPSHOT_PERIOD_S
    close_timeout_s = 30.0

    def __init__(self, spec: TrainSpec, prepared: PreparedWorker | None) -> None:
        self.spec, self.prepared = spec, prepared
        self._local_rank = int(os.environ.get(ENV_SLOT, "0"))
        self._collectives: TorchCollectives | None = None
        self.saved: dict[str, Any] | None = None  # the last commit's state (the rollback point)
        self.past_commit = False  # the core trained past `saved` (a collective failed mid-interval)
        self.uuid = 0  # the world this process is in (0: none)
        self.leave_requested = threading.Event()
        self.left = threading.Event()
        self.aborter = CollectiveAborter()
        self.watch: WorldSource | None = None
        self.store: Any = None  # the process-group store (`connect`)
        self.static = False  # one world per process (plain torchrun)
        self._phases: dict[str, float] = {}  # the last state agreement's phases (its log line)

    @property
    def collectives(self) -> TorchCollectives:
        assert self._collectives is not None, "join() first"
        return self._collectives

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def cuda_index(self) -> int:
        """This worker's GPU among those its process sees (a launcher's worker sees the node's)."""
        return self._local_rank

    def run_root(self, core: TrainCore) -> Path:
        return Path(core.work_dir).parent  # the worker directory (the core's is `run/` inside it)

    def wants_change(self) -> bool:
        return self.leave_requested.is_set() or (self.watch is not None and self.watch.latest_uuid() > self.uuid)

    # ---- joining the job -------------------------------------------------------------------------
    def connect(self, runner: WorkerRunner) -> tuple[Any, Callable[[int], WorldSource]]:
        """Where this worker's worlds come from: the process-group store (a c10d store with `add`
        and an `abort_check` hook, `EtcdStore`) and a maker of its `WorldSource` given its
        incarnation. Here: etcd and the leader's coordinator; an engine on another cluster manager
        overrides this and reuses the rest."""
        env = runner.env
        connected = env.etcd_client(timeout=10.0)
        if connected is None or env.generation is None or env.node_id is None:
            raise UserError("engine=torch workers are started by an elasticyolo agent: the job, node and "
                            "etcd are not in the environment")
        client, keys = connected
        generation, node = env.generation, env.node_id
        store = EtcdStore(client, keys.torch_store(generation), timeout=timedelta(seconds=ENTER_TIMEOUT_S), watch=True)
        return store, lambda incarnation: WorldWatch(client, keys, generation, node, self.local_rank, incarnation)

    def join(self, runner: WorkerRunner) -> TrainCore:
        if not runner.env.connected and os.environ.get("TORCHELASTIC_RUN_ID"):
            return self._join_under_torchrun(runner)
        store, make_source = self.connect(runner)
        incarnation = store.add("incarnation", 1)
        backend = "nccl" if torch.cuda.is_available() and self.spec.device not in ("cpu",) else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(self.cuda_index)
        dist.init_process_group(backend, store=store, rank=incarnation, world_size=1 << 20,
                                timeout=timedelta(seconds=self.spec.gloo_timeout_s), enable_reconfigure=True)
        self.store = store
        self.watch = make_source(incarnation)
        self.watch.on_world = self._on_world
        self.watch.start()
        if self.prepared is None:
            size = os.environ.get(ENV_SLOTS, "")
            core = TrainCore(self.spec, rank=0, world=1, local_rank=self.local_rank, work_dir=runner.env.run_dir,
                             local_size=int(size) if size.isdigit() else None)
        else:
            core = self.prepared.core
            runner.store = self.prepared.store
        core.progress.world = 0  # the first world's set_world is not a resize
        self._collectives = TorchCollectives(core.device)
        self._install_sigterm(runner)
        self.watch.register(dist._get_reconfigure_handle())
        log.info("torch worker registered", member=self.watch.member)
        return core

    def _join_under_torchrun(self, runner: WorkerRunner) -> TrainCore:
        """Under plain torchrun (the benchmarks' baseline): one world per process, from torch
        elastic's environment; torchrun restarts the world on any change, and every start
        restores the newest state (`WorkerWorld.run`)."""
        backend = "nccl" if torch.cuda.is_available() and self.spec.device not in ("cpu",) else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=self.spec.gloo_timeout_s))
        rank, size = dist.get_rank(), dist.get_world_size()
        core = self.prepared.core if self.prepared is not None else TrainCore(
            self.spec, rank=rank, world=size, local_rank=self.local_rank, work_dir=runner.env.run_dir)
        core.set_world(size, rank)
        core.grad_allreduce = make_allreduce(size, self.spec.fp16_allreduce, lambda: 0, lambda _: None)
        self._collectives = TorchCollectives(core.device)
        self._collectives.rank, self._collectives.size = rank, size
        self.static = True
        return core

    def _install_sigterm(self, runner: WorkerRunner) -> None:
        def on_sigterm() -> bool:
            if self.leave_requested.is_set():
                return True
            self.leave_requested.set()
            assert self.watch is not None
            self.watch.leave()
            self.watch.poke()

            def deadline() -> None:  # no commit came in time (a peer hangs): leave anyway
                if not self.left.wait(LEAVE_WAIT_S):
                    runner.snapshots.flush(5.0)
                    os._exit(143)

            threading.Thread(target=deadline, name="leave-deadline", daemon=True).start()
            return True

        self._sigterm = on_sigterm

    def _on_world(self, world: World) -> None:
        """A newer world is out: if it lost a member of ours (a frozen or dead node), abort the
        collective we may be blocked in, so we enter it now rather than at Gloo's timeout."""
        if world.abort and self.uuid and self.watch is not None and self.watch.member in world.members:
            n = self.aborter.abort()
            log.info("aborting the world's collective", uuid=self.uuid, next=world.uuid, connections=n)

    # ---- the worlds ------------------------------------------------------------------------------
    def run(self, runner: WorkerRunner) -> Summary | None:
        if self.static:
            return super().run(runner)
        assert self.watch is not None
        finish_snapshot_on_sigterm(runner.snapshots, stop_at_commit=self._sigterm)
        watch, core = self.watch, runner.core
        worker_errors.joined_world()  # from here on, a failure may be a peer's doing (engines/crash_loop.py)
        first = True
        while True:
            if self.leave_requested.is_set():
                return self._leave(runner)
            world = watch.wait(lambda w: self.leave_requested.is_set()
                               or (w is not None and w.uuid > self.uuid and watch.member in w.members))
            if self.leave_requested.is_set() or world is None:
                continue
            before = core.progress.step
            if not self._enter(world):
                continue
            try:
                restored = self._agree_state(runner)
                if core.rank == 0 and runner.progress is not None:
                    lost = None if first else max(0, before - core.progress.step)
                    runner.progress.resume(core.progress.step, core.world, lost,
                                           "start" if first else "reform", source=restored)
                first = False
                commit = InPlaceCommit(self, core)
                core.grad_allreduce = make_allreduce(core.world, self.spec.fp16_allreduce, commit.flag, commit.on_flag)
                return runner.session(commit, resume={"source": restored, "uuid": world.uuid,
                                                      "node": runner.env.node_id, "local_rank": self.local_rank,
                                                      "pid": os.getpid()}, source=restored, uuid=world.uuid)
            except WorldChanged as change:
                if change.leaving:
                    return self._leave(runner)
                log.info("leaving the world at a commit", uuid=self.uuid, step=core.progress.step)
            except CollectiveFailed as exc:
                self.past_commit = True
                watch.failed(self.uuid)
                runner.trace.write("failed", rank=core.rank, world=core.world, step=core.progress.step, uuid=self.uuid)
                log.info("collective failed; re-forming", uuid=self.uuid, step=core.progress.step, error=str(exc))
            self.aborter.left()

    def _enter(self, world: World) -> bool:
        assert self.watch is not None
        watch = self.watch
        t0 = time.perf_counter()
        self.aborter.left()
        self.store.abort_check = lambda _key: ("a newer world is out" if watch.latest_uuid() > world.uuid else None)
        try:
            guarded(lambda: dist._reconfigure(uuid=world.uuid, handles=list(world.handles),
                                              timeout=timedelta(seconds=ENTER_TIMEOUT_S)).wait())
        except (CollectiveFailed, LookupError) as exc:
            log.info("could not enter the world", uuid=world.uuid, error=str(exc).splitlines()[0])
            watch.entered(world.uuid, False, dist._get_reconfigure_handle())
            return False
        finally:
            self.store.abort_check = None
        self.uuid = world.uuid
        self.aborter.joined()
        watch.entered(world.uuid, True, dist._get_reconfigure_handle())
        rank, size = world.members.index(watch.member), world.size
        self.collectives.rank, self.collectives.size = rank, size
        log.info("entered world", uuid=world.uuid, rank=rank, world_size=size,
                 seconds=round(time.perf_counter() - t0, 3), reason=world.reason)
        return True

    def _agree_state(self, runner: WorkerRunner) -> str:
        """Every rank at the newest committed state; returns where this rank's came from."""
        t0 = time.perf_counter()
        self._phases.clear()
        source = self._agree_state_now(runner)
        log.info("state agreed", source=source, step=runner.core.progress.step,
                 seconds=round(time.perf_counter() - t0, 3),
                 **{k: round(v - t0, 3) for k, v in self._phases.items()})
        return source

    def _agree_state_now(self, runner: WorkerRunner) -> str:
        core, coll = runner.core, self.collectives
        core.set_world(coll.size, coll.rank)
        step = state_step(self.saved) if self.saved is not None else -1
        if step < 0:
            prime_optimizer_state(core.optimizer)  # its tensors line up with the holders' (state_shares)
        sig = int(signature(state_tensors([core.model, core.ema.ema], core.optimizer)[0])[:15], 16)
        everyone = coll.allgather_ints([step, sig])
        self._phases["gathered_s"] = time.perf_counter()
        steps = [e[0] for e in everyone]
        best = max(steps)
        if best < 0:  # nobody holds a state: a fresh job or a full restart
            restored = runner.restore()
            self.saved = core_state(core)
            return restored.source
        holders = [r for r, s in enumerate(steps) if s == best]
        if coll.rank in holders:
            self._roll_back(core)
        if len(holders) == coll.size:
            return "memory"
        if all(e[1] == everyone[0][1] for e in everyone):
            # The holders send their state in shares, as raw bytes (train/state_shares.py).
            receivers = [r for r in range(coll.size) if r not in holders]
            # Read again, not reused from the signature above: a holder's roll-back may have
            # loaded the commit into new optimizer tensors (`train.state.roll_back`).
            tensors, plain = state_tensors([core.model, core.ema.ema], core.optimizer)
            self._phases["rolled_back_s"] = time.perf_counter()
            send_shards(tensors, holders, receivers, rank=coll.rank, size=coll.size, alltoall=torch_alltoall)
            self._phases["sent_s"] = time.perf_counter()
            mine = (plain, progress_dict(core), core.scaler.state_dict() if core.scaler.is_enabled() else None,
                    int(core.ema.updates)) if coll.rank == holders[0] else None
            plain, progress, scaler, ema_updates = coll.broadcast_object(mine, holders[0])
            if coll.rank in holders:
                return "memory"
            apply_plain(core.optimizer, plain)
            core.progress = progress_from(progress)
            core.ema.updates = ema_updates
            if scaler and core.scaler.is_enabled():
                core.scaler.load_state_dict(scaler)
            core.sync_sampler_from_progress()
        else:  # the tensors do not line up (never seen): the whole state, pickled, from one holder
            state = send_state(self.saved if coll.rank == holders[0] else None, holders[0], coll)
            if coll.rank in holders:
                return "memory"
            load_core_state(core, state)
        self.saved, self.past_commit = core_state(core), False
        core.set_world(coll.size, coll.rank)
        return "peer"

    def _roll_back(self, core: TrainCore) -> None:
        """The core at `saved` again, only if it trained past it (a world left at a commit holds
        exactly the committed state); `saved` stays the rollback point."""
        if self.past_commit:
            assert self.saved is not None
            roll_back(core, self.saved)
            self.past_commit = False

    def _leave(self, runner: WorkerRunner) -> None:
        assert self.watch is not None
        core = runner.core
        runner.trace.write("left", rank=core.rank, step=core.progress.step)
        log.info("left the job", step=core.progress.step, uuid=self.uuid)
        self.watch.leave()
        runner.snapshots.flush(5.0)
        self.left.set()
        return None


def main(spec: TrainSpec, *, commit_target_s: float, sinks: list[ProgressSink] | None = None,
         progress: EtcdProgress | None = None, prepared: PreparedWorker | None = None) -> int:
    """The worker entry point (`elasticyolo worker` through the engine registry).
    `prepared`: by a warm process before its slot was handed over, else everything is built here."""
    world = TorchWorld(spec, prepared)
    runner = WorkerRunner(spec, world, commit_target_s=commit_target_s, sinks=sinks, progress=progress)
    try:
        summary = runner.run()
    finally:
        if world.watch is not None:
            world.watch.stop()
    # Finished as another rank than 0: rank 0's node ends the job, once its run folder is out.
    elsewhere = summary is not None and not world.static and runner.core.rank != 0
    os._exit(EXIT_FINISHED_ELSEWHERE if elsewhere else 0)  # a group abandoned mid-collective must not hold the exit
