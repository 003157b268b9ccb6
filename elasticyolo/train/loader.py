"""The elastic data loader: persistent worker processes that prefetch along the sampler's plan.

The training process asks for the batch at a position, `get(stream, key, plan)`. The loader keeps
the next `prefetch x workers` requests of the current plan in flight; when the position asked
for is not the head of that plan (a reset rolled back to a commit, the world was resized, a
state was restored), the plan restarts there and everything prefetched for the old one is
discarded at once:

- each request carries a sequence number, and a shared per-stream *floor* (the lowest number
  still wanted) is raised past the old plan: workers skip stale requests without building them
  and stale results are dropped on arrival. Nothing waits for old work to finish (torch's
  `DataLoader._reset` waits for every queued batch first, which would add to a reset's pause);
- the batch handed out carries the indices it was built from, so the trace shows what was
  really trained.

Streams ("train", "val") have their own plans, so validating at an epoch end keeps the next
epoch's prefetched training batches.

The processes (see `loader_worker.py`) come from the fork server (`elasticyolo.mp`), never from
the training process itself (which may already run Horovod/Gloo/NCCL threads), start in the
background, and live as long as the training process: resets, resizes and rollbacks only change
the plan. Until they are ready, and with `workers=0`, batches are built in the training process.
If a worker dies, the pool is replaced and the requests in flight are sent again. On CUDA a
receiver thread pins each batch, so the copy to the device is asynchronous.
"""

from __future__ import annotations

import collections
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterator, Mapping

import torch

from elasticyolo.exit_hooks import at_exit
from elasticyolo.log import get_logger
from elasticyolo.train.graphs import CAPTURE_LOCK
from elasticyolo.train.loader_worker import BatchBuilder, request_seed

log = get_logger("elasticyolo.loader")

MAX_POOL_RESTARTS = 3


class LoaderError(RuntimeError):
    """A batch could not be built (the worker's traceback is in the message)."""


@dataclass(frozen=True)
class Request:
    key: Hashable  # what the consumer asks for: e.g. (epoch, start, world, rank)
    dataset: str
    indices: tuple[int, ...]
    variant: str = ""
    seed_key: Hashable = None  # what the augmentation's draws depend on (None: the key)

    def seed(self, base: int) -> int:
        return request_seed(base, self.key if self.seed_key is None else self.seed_key)


@dataclass
class LoaderStats:
    batches: int = 0
    inline: int = 0  # built in the training process (workers=0, or workers not ready yet)
    wait_s: dict[str, float] = field(default_factory=dict)  # per stream: time get() spent obtaining batches
    replans: int = 0
    discarded: int = 0  # prefetched requests dropped by replans
    pool_restarts: int = 0


@dataclass
class _Pending:
    request: Request
    seq: int | None  # None: built in the training process (empty, no workers, inline-only stream)


@dataclass
class _Stream:
    index: int
    plan: Iterator[Request] | None = None
    pending: collections.deque[_Pending] = field(default_factory=collections.deque)
    inline_only: bool = False


def loader_workers(requested: int, local_size: int = 1) -> int:
    """Ultralytics' rule: at most `requested`, at most the CPUs per training process on this node."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(0, min(requested, cpus // max(local_size, 1)))


class _Pool:
    """One generation of loader processes: a host from the fork server and its forked workers,
    their queues, and the receiver thread that files their results."""

    def __init__(self, loader: "BatchLoader", payload: bytes) -> None:
        from elasticyolo.train.loader_worker import host_main

        ctx = loader.ctx
        self.loader = loader
        self.tasks = ctx.Queue()
        self.out = ctx.Queue()
        self.floors = ctx.RawArray("q", max(len(loader.streams), 1))
        self.conn, host_end = ctx.Pipe()
        self.ready: set[int] = set()
        self.failed: str | None = None
        self.proc = ctx.Process(
            target=host_main, name="elasticyolo-loader", daemon=True,
            args=(payload, loader.workers, self.tasks, self.out, self.floors,
                  loader.seed * 1_000_003 + loader.stats.pool_restarts, host_end),
        )
        self.started = threading.Event()
        self.receiver = threading.Thread(target=self._receive, name="loader-receiver", daemon=True)
        self.receiver.start()
        threading.Thread(target=self._start, name="loader-start", daemon=True).start()

    def _start(self) -> None:
        t0 = time.perf_counter()
        try:
            self.proc.start()  # waits for the fork server (its imports, the first time)
            log.debug("loader_started", workers=self.loader.workers, seconds=round(time.perf_counter() - t0, 2))
        except BaseException as exc:  # noqa: BLE001 - the training process goes on inline
            self.failed = f"could not start: {type(exc).__name__}: {exc}"
            log.error("loader_start_failed", error=self.failed)
        finally:
            self.started.set()
            with self.loader.cond:
                self.loader.cond.notify_all()

    @property
    def is_ready(self) -> bool:
        return self.failed is None and len(self.ready) >= self.loader.workers

    def send(self, seq: int, stream: int, req: Request) -> None:
        self.tasks.put((seq, stream, req.dataset, req.indices, req.variant, req.seed(self.loader.seed)))

    def check(self) -> str | None:
        """Why this pool is broken (a process died), or None."""
        if self.failed is not None:
            return self.failed
        if self.started.is_set() and self.proc.exitcode is not None:
            self.failed = f"loader host pid {self.proc.pid} exited with {self.proc.exitcode}"
        else:
            try:
                while self.conn.poll():
                    _, wid, pid, code = self.conn.recv()
                    self.failed = f"loader worker {wid} (pid {pid}) exited with {code}"
            except (EOFError, OSError):
                self.failed = "loader host is gone"
        return self.failed

    def close(self, timeout: float = 5.0) -> None:
        self.started.wait(timeout)
        try:
            self.conn.send("stop")
        except (OSError, ValueError):
            pass
        if self.proc.pid is not None:
            self.proc.join(timeout)
            if self.proc.is_alive():
                self.proc.terminate()
                self.proc.join(1.0)
        self.out.put(None)  # stops the receiver
        self.receiver.join(timeout)
        for q in (self.tasks, self.out):
            q.cancel_join_thread()
            q.close()
        self.conn.close()

    def _receive(self) -> None:
        loader = self.loader
        if loader.pin:
            torch.cuda.set_device(loader.device)
        while True:
            try:
                msg = self.out.get()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            if msg[0] == "ready":
                with loader.cond:
                    self.ready.add(msg[1])
                    loader.cond.notify_all()
                continue
            _, seq, stream, batch, err = msg
            if seq < self.floors[stream]:
                continue  # stale: dropped on arrival, nobody waits for it
            if batch is not None and loader.pin:
                batch = pin_batch(batch)
            with loader.cond:
                if seq >= self.floors[stream] and loader.pool is self:
                    loader.results[seq] = (stream, batch, err)
                    loader.cond.notify_all()


class BatchLoader:
    def __init__(self, datasets: Mapping[str, Any], hyp: Any, workers: int, *, device: torch.device | None = None,
                 seed: int = 0, prefetch: int = 2) -> None:
        self.workers = workers
        self.depth = max(prefetch * workers, 1)  # requests kept ahead of the consumer, per stream
        self.device = device
        self.pin = bool(device is not None and device.type == "cuda" and workers > 0)
        self.seed = seed
        self.stats = LoaderStats()
        self.on_replan: Callable[[str, Hashable, Hashable, int], None] | None = None
        self.streams = {name: _Stream(i) for i, name in enumerate(datasets)}
        self.cond = threading.Condition()
        self.results: dict[int, tuple[int, Any, str | None]] = {}  # seq -> (stream, batch, error)
        self.pool: _Pool | None = None
        self._builder = BatchBuilder(datasets, hyp, keep_rng=True)  # the in-process path
        self._datasets, self._hyp = dict(datasets), hyp
        self._seq = 0
        self._closed = False
        if workers > 0:
            from elasticyolo.mp import helper_context

            self.ctx = helper_context()
            self.pool = _Pool(self, self._payload())
            at_exit(_close_at_exit, weakref.ref(self))

    def _payload(self) -> bytes:
        """The datasets, pickled now (before this process builds any batch and fills their mosaic
        buffers), for the pool's host. Tensors (an image cache) travel as shared memory."""
        from multiprocessing.reduction import ForkingPickler

        return bytes(ForkingPickler.dumps((self._datasets, self._hyp)))

    # ---- lifecycle ---------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """The worker processes are up and serving."""
        return self.pool is not None and self.pool.is_ready

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the workers serve (a pre-warmed process calls this before it reports ready)."""
        if self.workers == 0:
            return True
        with self.cond:
            self.cond.wait_for(lambda: self.pool is None or self.pool.is_ready or self.pool.failed is not None,
                               timeout)
        return self.ready

    def add_local(self, name: str, dataset: Any) -> None:
        """A dataset built in the training process only (e.g. validation when it was off at start)."""
        self._builder.add(name, dataset)
        self.streams[name] = _Stream(-1, inline_only=True)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (idempotent). Also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.close(timeout)
        with self.cond:
            self.results.clear()
            self.cond.notify_all()

    # ---- the consumer's side -----------------------------------------------------------------
    def get(self, stream: str, key: Hashable, plan: Callable[[], Iterator[Request]]) -> dict[str, Any] | None:
        """The batch for `key`, the head of `stream`'s plan; `plan()` makes a new plan starting at
        `key` when it is not (the old plan's prefetched batches are discarded). None for a request
        with no indices (a rank with an empty shard)."""
        t0 = time.perf_counter()
        s = self.streams[stream]
        try:
            if not s.pending or s.pending[0].request.key != key:
                self._replan(stream, s, key, plan())
            item = s.pending.popleft()
            self._refill(s)  # keep the workers busy before waiting
            req = item.request
            if not req.indices:
                return None
            if item.seq is not None and self.ready:
                batch = self._wait(s, item)
            else:
                if item.seq is not None and self.pool is not None:
                    self.pool.floors[s.index] = item.seq + 1  # workers skip it; a late result is dropped
                batch = self._inline(req)
            self.stats.batches += 1
            return batch
        finally:
            self.stats.wait_s[stream] = self.stats.wait_s.get(stream, 0.0) + time.perf_counter() - t0

    def _inline(self, req: Request) -> dict[str, Any]:
        self.stats.inline += 1
        return self._builder.build(req.dataset, req.indices, req.variant, req.seed(self.seed))

    def _replan(self, name: str, s: _Stream, key: Hashable, plan: Iterator[Request]) -> None:
        old = s.pending[0].request.key if s.pending else None
        dropped = sum(1 for p in s.pending if p.request.indices)
        s.pending.clear()
        s.plan = plan
        if s.index >= 0 and self.pool is not None:
            with self.cond:
                self.pool.floors[s.index] = self._seq  # everything sent before now is stale
                for seq in [q for q, r in self.results.items() if r[0] == s.index]:
                    del self.results[seq]
        self.stats.replans += 1
        self.stats.discarded += dropped
        self._refill(s)
        if not s.pending or s.pending[0].request.key != key:
            raise LoaderError(f"{name}: the new plan does not start at {key!r}")
        if self.on_replan is not None:
            self.on_replan(name, old, key, dropped)

    def _send(self, s: _Stream, item: _Pending) -> None:
        assert self.pool is not None
        item.seq = self._seq
        self._seq += 1
        self.pool.send(item.seq, s.index, item.request)

    def _refill(self, s: _Stream) -> None:
        while s.plan is not None and len(s.pending) < self.depth:
            req = next(s.plan, None)
            if req is None:
                s.plan = None
                return
            item = _Pending(req, None)
            if req.indices and self.pool is not None and not s.inline_only:
                self._send(s, item)
            s.pending.append(item)

    def _wait(self, s: _Stream, item: _Pending) -> Any:
        while True:
            pool = self.pool
            if pool is None:
                raise LoaderError("the data loader was closed")
            with self.cond:
                self.cond.wait_for(lambda: item.seq in self.results or self.pool is not pool, 1.0)
                if item.seq in self.results:
                    _, batch, err = self.results.pop(item.seq)
                    break
            broken = pool.check()
            if broken is not None:
                self._replace_pool(broken, s, item)
                if not self.ready:  # the new pool is starting: build this one here
                    pool = self.pool
                    if pool is not None and item.seq is not None:
                        pool.floors[s.index] = item.seq + 1
                    return self._inline(item.request)
        assert item.seq is not None
        pool.floors[s.index] = item.seq + 1
        if err is not None:
            raise LoaderError(err)
        return batch

    def _replace_pool(self, why: str, current: _Stream, item: _Pending) -> None:
        """A loader process died: start a fresh pool and send it everything in flight."""
        self.stats.pool_restarts += 1
        if self.stats.pool_restarts > MAX_POOL_RESTARTS:
            raise LoaderError(f"data loader processes keep dying ({why})")
        log.warning("loader_pool_restart", why=why, restarts=self.stats.pool_restarts)
        old = self.pool
        with self.cond:
            self.results.clear()
            self.pool = _Pool(self, self._payload())
            self.cond.notify_all()
        if old is not None:
            threading.Thread(target=old.close, args=(2.0,), name="loader-stop", daemon=True).start()
        for s in self.streams.values():
            if s.index < 0:
                continue
            for it in ([item] if s is current else []) + list(s.pending):
                if it.seq is not None:
                    self._send(s, it)


def _close_at_exit(ref: "weakref.ref[BatchLoader]") -> None:
    loader = ref()
    if loader is not None:
        loader.close()


def pin_batch(batch: dict[str, Any]) -> dict[str, Any]:
    with CAPTURE_LOCK:  # never beside a CUDA graph capture (train/graphs.py)
        return {k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
