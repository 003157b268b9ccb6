"""Periodic checkpoints: a blocking snapshot in the training process, everything else in an
uploader process.

The training thread calls `maybe_save(...)` every step. When a checkpoint is due it calls the
caller's `snapshot_fn()`, whose tensor copies go straight into a shared-memory slot (see
`shipping.py`): that copy to host memory is all training waits for. The slot and the snapshot's
structure are handed to the uploader process (`uploader.py`), which serializes, hashes,
uploads, verifies, writes the manifest (never overwritten) and only then moves `latest.json`.

At most one snapshot waits behind the one uploading: a newer snapshot replaces it, so memory
stays bounded (two slots) when the store is slow or down. Failed uploads are retried with
backoff until they land, a newer snapshot supersedes them, or `close()` gives up; training never
waits for them. The uploader reports back over a pipe (landed, failed, log records), and this
side keeps the status, metrics and logs, so they look as if the work happened here.

Importing this module does not import torch.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Literal, Mapping

from elasticyolo.checkpoint import layout
from elasticyolo.checkpoint.adaptive import YoungDaly
from elasticyolo.checkpoint.hashing import sha256_of
from elasticyolo.checkpoint.layout import Manifest
from elasticyolo.checkpoint.metrics import get_metrics
from elasticyolo.checkpoint.stores import Store
from elasticyolo.checkpoint.uploader import Job, UploadOptions, VerifyError
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.checkpoint")

SnapshotFn = Callable[[], Mapping[str, Any]]
Serializer = Callable[[Mapping[str, Any], IO[bytes]], None]

__all__ = ["CheckpointManager", "Serializer", "SnapshotFn", "VerifyError", "sha256_of"]


@dataclass
class _Job:
    job: Job
    slot: int
    skeleton: bytes = b""
    released: bool = False  # the uploader is done with the slot (it may hold another snapshot now)
    resent: bool = False  # sent again after the uploader died holding it (only once: it may be why)

    @property
    def step(self) -> int:
        return self.job.step


@dataclass
class _Slots:
    """Two shared-memory slots: one may be the uploader's (sent, its upload not over: the upload
    reads the tensors' bytes from the slot), the other takes the next snapshot."""

    slots: list[Any] = field(default_factory=lambda: [None, None])
    owner: list[int | None] = field(default_factory=lambda: [None, None])  # job id the uploader holds it for

    def get(self, i: int) -> Any:
        if self.slots[i] is None:
            from elasticyolo.checkpoint.shipping import HostSlot

            self.slots[i] = HostSlot()
        return self.slots[i]


class CheckpointManager:
    def __init__(
        self,
        store: Store,
        job: str,
        *,
        save_period_steps: int = 200,
        save_period_s: float = 300.0,
        keep_last: int = 3,
        keep_epochs: bool = False,
        adaptive: bool = False,
        adaptive_opts: Mapping[str, Any] | None = None,
        start_step: int = 0,
        verify: Literal["head", "full"] = "head",
        retry_initial_s: float = 1.0,
        retry_max_s: float = 60.0,
        orphan_grace_s: float = 3600.0,
        spool_max_bytes: int = 512 * 1024 * 1024,
        background_nice: int = 19,
        serializer: Serializer | None = None,
        registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`serializer` (tests) runs in the uploader process, so it must pickle by reference (a
        module-level function or a picklable object); so must `store`, apart from its locks and
        network clients (see `shipping.dumps_portable`)."""
        self.store = store
        self.job = layout.check_job(job)
        self.save_period_steps = save_period_steps
        self.save_period_s = save_period_s
        self.keep_last = keep_last
        self.keep_epochs = keep_epochs
        self.adaptive = YoungDaly(clock=clock, **dict(adaptive_opts or {})) if adaptive else None
        self.options = UploadOptions(keep_last=keep_last, keep_epochs=keep_epochs, verify=verify,
                                     retry_initial_s=retry_initial_s, retry_max_s=retry_max_s,
                                     orphan_grace_s=orphan_grace_s, spool_max_bytes=spool_max_bytes)
        self.background_nice = background_nice
        self._serializer = serializer
        self._clock = clock
        self._m = get_metrics(registry).for_job(self.job)

        self._last_step = start_step  # step of the last snapshot taken (or restored)
        self._last_time = clock()
        self._last: Manifest | None = None  # newest checkpoint that landed
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._slots = _Slots()
        self._pending: _Job | None = None  # captured, not yet sent
        self._inflight: _Job | None = None  # sent to the uploader
        self._retrying = False  # the in-flight one failed and waits to retry
        self._next_id = 1
        self._proc: Any = None
        self._conn: Any = None
        self._starting = False
        self._stopping = False
        self.failures = 0  # consecutive failed attempts
        self.last_error: str | None = None
        self.superseded = 0

    # ---- training-thread API ---------------------------------------------------------------
    def due(self, step: int, *, epoch_end: bool = False, force: bool = False) -> str | None:
        """Why a checkpoint is due at `step` (None if not). Step periods count from multiples of
        the period, so whichever rank 0 (after a resize) saves at the same steps."""
        if force:
            return "forced"
        if epoch_end:
            return "epoch_end"
        if step <= self._last_step:
            return None
        elapsed = self._clock() - self._last_time
        if self.adaptive is not None:
            return "adaptive" if elapsed >= self.adaptive.interval_s() else None
        if self.save_period_steps > 0 and step // self.save_period_steps > self._last_step // self.save_period_steps:
            return "period_steps"
        if self.save_period_s > 0 and elapsed >= self.save_period_s:
            return "period_s"
        return None

    def maybe_save(self, step: int, epoch: int, snapshot_fn: SnapshotFn, *, epoch_end: bool = False,
                   force: bool = False, reason: str | None = None) -> bool:
        """Call once per optimizer step (after it) on the rank that checkpoints. Returns whether a
        snapshot was taken. Blocks only for `snapshot_fn()`'s copy to host memory."""
        why = self.due(step, epoch_end=epoch_end, force=force)
        if why is None:
            return False
        if self._stopping:
            log.warning("checkpoint_after_close", job=self.job, step=step)
            return False
        from elasticyolo.checkpoint import shipping

        t0 = time.perf_counter()
        self._last_step, self._last_time = max(step, self._last_step), self._clock()
        with self._cond:
            if self._pending is not None:  # its slot takes the new snapshot
                self._drop(self._pending.job, "a newer snapshot was taken")
                index, self._pending = self._pending.slot, None
            else:
                free = [i for i, owner in enumerate(self._slots.owner) if owner is None]
                if not free:  # not expected: the uploader holds at most one slot
                    log.warning("checkpoint_no_free_slot", job=self.job, step=step)
                    return False
                index = free[0]
        slot = self._slots.get(index)
        try:
            with shipping.capture(slot):
                ckpt = snapshot_fn()
            skeleton = shipping.dumps(ckpt, slot)
            del ckpt
        except Exception as exc:  # noqa: BLE001 - a failed snapshot skips one checkpoint, not the run
            self.last_error = f"snapshot: {type(exc).__name__}: {exc}".replace("\n", " ")[:300]
            log.error("checkpoint_snapshot_failed", job=self.job, step=step, error=self.last_error, exc_info=True)
            return False
        snapshot_s = time.perf_counter() - t0
        self._m["snapshot_seconds"].observe(snapshot_s)
        with self._cond:
            job = Job(self._next_id, step, epoch, reason or why, snapshot_s, layout.new_name(step), time.time())
            self._next_id += 1
        self._submit(_Job(job, index, skeleton))
        return True

    def save(self, step: int, epoch: int, snapshot_fn: SnapshotFn, *, reason: str = "forced",
             wait: bool = False, timeout: float | None = None) -> bool:
        """On demand (drain, job end). With wait=True, returns whether it landed within timeout."""
        self.maybe_save(step, epoch, snapshot_fn, force=True, reason=reason)
        return self.wait(timeout) if wait else True

    def note_restored(self, manifest: Manifest) -> None:
        """After a restore: periods count from the restored step, status shows it as the last."""
        self._last_step = max(self._last_step, manifest.step)
        self._last = manifest
        self._last_time = self._clock()

    def observe_preemption(self, count: int = 1) -> None:
        if self.adaptive is not None:
            self.adaptive.observe_preemption(count)

    def wait(self, timeout: float | None = None) -> bool:
        """Until nothing is pending or uploading. True if the last snapshot taken has landed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._pending is not None or self._inflight is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(min(left, 1.0) if left is not None else 1.0)
            return self._last is not None and self._last.step >= self._last_step

    def close(self, timeout: float | None = 60.0) -> bool:
        """Let the pending upload finish (up to timeout), then stop the uploader. Idempotent."""
        landed = self.wait(timeout)
        with self._cond:
            self._stopping = True
            proc, conn = self._proc, self._conn
        if proc is not None:
            try:
                with self._send_lock:
                    conn.send(("stop", not landed))
            except (OSError, ValueError):
                pass
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
        with self._cond:
            if not landed and self._inflight is not None:
                log.error("checkpoint_abandoned", job=self.job, step=self._inflight.step)
            self._pending = self._inflight = None
            self._cond.notify_all()
        return landed

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- status -----------------------------------------------------------------------------
    @property
    def last(self) -> Manifest | None:
        return self._last

    def status(self) -> dict[str, Any]:
        """JSON-able, for the world key in etcd and `elasticyolo status`."""
        with self._cond:
            pending = self._pending.step if self._pending else None
            inflight = self._inflight.step if self._inflight else None
        out: dict[str, Any] = {
            "store": self.store.uri,
            "last": self._last.summary() if self._last else None,
            "pending_step": pending,
            "uploading_step": inflight,
            "consecutive_failures": self.failures,
            "last_error": self.last_error,
            "superseded": self.superseded,
        }
        if self.adaptive is not None:
            out["adaptive_interval_s"] = round(self.adaptive.interval_s(), 1)
            out["mtbf_s"] = round(self.adaptive.mtbf_s(), 1)
        return out

    # ---- handing jobs to the uploader ---------------------------------------------------------
    def _submit(self, job: _Job) -> None:
        with self._cond:
            self._pending = job
            start = self._proc is None and not self._starting
            self._starting |= start
        if start:
            threading.Thread(target=self._start_uploader, name=f"ckpt-uploader-start-{self.job}", daemon=True).start()
        else:
            self._send_pending()

    def _send_pending(self) -> None:
        """Send the pending snapshot if the uploader can take it: it is idle, or it is waiting
        to retry a failed upload (which the newer snapshot then supersedes)."""
        with self._cond:
            job = self._pending
            if job is None or self._conn is None or (self._inflight is not None and not self._retrying):
                return
            slot = self._slots.get(job.slot)
            self._pending, self._inflight, self._retrying = None, job, False
            self._slots.owner[job.slot] = job.job.id
            self._cond.notify_all()
        try:
            with self._send_lock:
                self._conn.send(("job", job.job, slot.buffers(), job.skeleton))
        except (OSError, ValueError) as exc:
            log.warning("checkpoint_uploader_unreachable", job=self.job, error=str(exc))

    def _start_uploader(self) -> None:
        from elasticyolo.checkpoint import uploader
        from elasticyolo.checkpoint.shipping import dumps_portable
        from elasticyolo.mp import helper_context, start_fork_server

        try:
            ctx = helper_context()
            start_fork_server()  # a simulated node runs it on its host side (train/sim_accelerator.py)
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=uploader.main, name=f"elasticyolo-ckpt-{self.job}", daemon=True,
                               args=(theirs, dumps_portable(self.store), self.job, self.options, self._serializer,
                                     self.background_nice, dict(os.environ)))
            proc.start()
            theirs.close()
        except Exception as exc:  # noqa: BLE001 - reported; the next checkpoint tries again
            self.last_error = f"uploader: {type(exc).__name__}: {exc}".replace("\n", " ")[:300]
            log.error("checkpoint_uploader_start_failed", job=self.job, error=self.last_error)
            with self._cond:
                self._starting = False
                if self._pending is not None:
                    self._drop(self._pending.job, "the uploader did not start")
                    self._pending = None
                self._cond.notify_all()
            return
        with self._cond:
            self._proc, self._conn, self._starting = proc, mine, False
            stopping = self._stopping
        if stopping:  # close() ran while it started
            mine.send(("stop", True))
            return
        threading.Thread(target=self._receive, args=(proc, mine), name=f"ckpt-uploader-{self.job}",
                         daemon=True).start()
        self._send_pending()

    # ---- what the uploader reports ------------------------------------------------------------
    def _receive(self, proc: Any, conn: Any) -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._handle(msg)
            except Exception:  # noqa: BLE001 - a bad report must not kill the receiver
                log.error("checkpoint_report_failed", job=self.job, report=str(msg)[:200], exc_info=True)
        self._uploader_gone(proc)

    def _handle(self, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "log":
            _, level, event, fields = msg
            getattr(log, level)(event, **fields)
            return
        with self._cond:
            if kind == "released":
                for i, owner in enumerate(self._slots.owner):
                    if owner == msg[1]:
                        self._slots.owner[i] = None
                if self._inflight is not None and self._inflight.job.id == msg[1]:
                    self._inflight.released = True
            elif kind == "failed":
                _, job_id, error, attempts, delay, permanent = msg
                self.failures += 1
                self.last_error = error
                self._m["upload_failures"].inc()
                if self._inflight is not None and self._inflight.job.id == job_id:
                    self._retrying = True
                step = self._inflight.step if self._inflight is not None else None
                (log.error if permanent else log.warning)(
                    "checkpoint_upload_failed", job=self.job, step=step, attempt=attempts, retry_in_s=delay,
                    error=error, permanent=permanent)
            elif kind == "dropped":
                _, job_id, why = msg
                if self._inflight is not None and self._inflight.job.id == job_id:
                    if why != "abandoned":
                        self._drop(self._inflight.job, why)
                    self._inflight = None
                elif why != "abandoned":
                    self.superseded += 1
                    self._m["superseded"].inc()
                    log.warning("checkpoint_superseded", job=self.job, why=why)
            elif kind == "landed":
                _, job_id, raw = msg
                self.failures, self.last_error = 0, None
                self._landed(Manifest.from_json(raw))
                if self._inflight is not None and self._inflight.job.id == job_id:
                    self._inflight = None
            self._cond.notify_all()
        if kind in ("failed", "dropped", "landed"):
            self._send_pending()

    def _uploader_gone(self, proc: Any) -> None:
        """The uploader exited: after close() that is expected; otherwise it died (killed, out of
        memory) and the snapshot it held is lost unless its slot was not read yet."""
        proc.join(1.0)
        with self._cond:
            if self._proc is proc:
                self._proc = self._conn = None
            if self._stopping:
                return
            lost = self._inflight
            self._inflight, self._retrying = None, False
            self._slots.owner = [None, None]
            if lost is not None:
                self.last_error = f"uploader exited with {proc.exitcode}"
                log.error("checkpoint_uploader_died", job=self.job, step=lost.step, exitcode=proc.exitcode)
                if self._pending is None and not lost.released:  # its slot still holds the snapshot
                    if lost.resent:
                        self._drop(lost.job, "the uploader died twice on this snapshot")
                    else:
                        lost.resent = True
                        self._pending = lost  # send it again
            restart = self._pending is not None and not self._starting
            self._starting |= restart
            self._cond.notify_all()
        if restart:
            self._start_uploader()

    def _drop(self, job: Job, why: str) -> None:
        self.superseded += 1
        self._m["superseded"].inc()
        log.warning("checkpoint_superseded", job=self.job, step=job.step, why=why)

    def _landed(self, manifest: Manifest) -> None:
        self._last = manifest
        m = self._m
        m["upload_seconds"].observe(manifest.upload_s)
        m["upload_bytes"].inc(manifest.size)
        m["saved"].inc()
        m["last_step"].set(manifest.step)
        m["last_success"].set(manifest.created)
        if self.adaptive is not None:
            self.adaptive.observe_cost(manifest.snapshot_s, manifest.upload_s)
        log.info("checkpoint_saved", job=self.job, step=manifest.step, epoch=manifest.epoch, size=manifest.size,
                 snapshot_s=round(manifest.snapshot_s, 4), upload_s=manifest.upload_s, reason=manifest.reason,
                 key=manifest.key)
