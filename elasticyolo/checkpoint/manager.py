"""Periodic checkpoints with a blocking snapshot and a background upload.

The training thread calls `maybe_save(...)` every step. When a checkpoint is due it calls the
caller's `snapshot_fn()` (copy the state to CPU: the only part that blocks training) and hands the
dict to one background thread, which pickles it to a spool file, hashes it (sha256), uploads it,
verifies the stored object, writes the manifest (conditional put: never overwritten) and only then
moves `latest.json`. At most one snapshot waits behind the one uploading: a newer snapshot
replaces it, so memory stays bounded when the store is slow or down. Failed uploads are retried
with backoff forever (until superseded or `close()` gives up); training never waits for them.

Torch is imported only on the upload thread (serialization), so importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import os
import random
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Literal, Mapping

from elasticyolo import __version__ as ELASTICYOLO_VERSION
from elasticyolo.checkpoint import catalog, layout
from elasticyolo.checkpoint.adaptive import YoungDaly
from elasticyolo.checkpoint.layout import Manifest
from elasticyolo.checkpoint.metrics import get_metrics
from elasticyolo.checkpoint.stores import NotFound, PreconditionFailed, Store
from elasticyolo.checkpoint.stores.retry import is_transient
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.checkpoint")

SnapshotFn = Callable[[], Mapping[str, Any]]
Serializer = Callable[[Mapping[str, Any], IO[bytes]], None]
_CHUNK = 8 * 1024 * 1024


class VerifyError(Exception):
    """The stored object does not match what was uploaded."""


def sha256_of(fileobj: IO[bytes]) -> tuple[str, int]:
    fileobj.seek(0)
    h, n = hashlib.sha256(), 0
    while chunk := fileobj.read(_CHUNK):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


def _torch_serialize(ckpt: Mapping[str, Any], out: IO[bytes]) -> None:
    from elasticyolo.checkpoint.format import serialize

    serialize(ckpt, out)


def _fields(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    from elasticyolo.checkpoint.format import manifest_fields

    return manifest_fields(ckpt)


@dataclass
class _Job:
    step: int
    epoch: int
    reason: str
    snapshot_s: float
    ckpt: Mapping[str, Any] | None
    name: str
    taken_at: float = field(default_factory=time.time)  # wall clock, comparable with manifests
    spool: Any = None  # SpooledTemporaryFile once serialized (kept across retries)
    sha256: str = ""
    size: int = 0
    fields: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0


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
        background_nice: int = 10,
        serializer: Serializer | None = None,
        registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.job = layout.check_job(job)
        self.save_period_steps = save_period_steps
        self.save_period_s = save_period_s
        self.keep_last = keep_last
        self.keep_epochs = keep_epochs
        self.adaptive = YoungDaly(clock=clock, **dict(adaptive_opts or {})) if adaptive else None
        self.verify = verify
        self.retry_initial_s, self.retry_max_s = retry_initial_s, retry_max_s
        self.orphan_grace_s = orphan_grace_s
        self.spool_max_bytes = spool_max_bytes
        self.background_nice = background_nice
        self._serialize = serializer or _torch_serialize
        self._clock = clock
        self._m = get_metrics(registry).for_job(self.job)

        self._last_step = start_step  # step of the last snapshot taken (or restored)
        self._last_time = clock()
        self._last: Manifest | None = None  # newest checkpoint that landed
        self._cond = threading.Condition()
        self._pending: _Job | None = None
        self._inflight: _Job | None = None
        self._stopping = False
        self._abort = False
        self._thread: threading.Thread | None = None
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
        snapshot was taken. Blocks only for `snapshot_fn()`."""
        why = self.due(step, epoch_end=epoch_end, force=force)
        if why is None:
            return False
        t0 = time.perf_counter()
        self._last_step, self._last_time = max(step, self._last_step), self._clock()
        try:
            ckpt = snapshot_fn()
        except Exception as exc:  # noqa: BLE001 - a failed snapshot skips one checkpoint, not the run
            self.last_error = f"snapshot: {type(exc).__name__}: {exc}".replace("\n", " ")[:300]
            log.error("checkpoint_snapshot_failed", job=self.job, step=step, error=self.last_error, exc_info=True)
            return False
        snapshot_s = time.perf_counter() - t0
        self._m["snapshot_seconds"].observe(snapshot_s)
        self._submit(_Job(step, epoch, reason or why, snapshot_s, ckpt, layout.new_name(step)))
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
                self._cond.wait(left if left is not None else 1.0)
            return self._last is not None and self._last.step >= self._last_step

    def close(self, timeout: float | None = 60.0) -> bool:
        """Let the pending upload finish (up to timeout), then stop the thread. Idempotent."""
        landed = self.wait(timeout)
        with self._cond:
            self._stopping = True
            self._abort = not landed
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)
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

    # ---- background thread ------------------------------------------------------------------
    def _submit(self, job: _Job) -> None:
        with self._cond:
            if self._stopping:
                log.warning("checkpoint_after_close", job=self.job, step=job.step)
                return
            if self._pending is not None:
                self._drop(self._pending, "a newer snapshot was taken")
            self._pending = job
            self._cond.notify_all()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name=f"ckpt-upload-{self.job}", daemon=True)
                self._thread.start()

    def _drop(self, job: _Job, why: str) -> None:
        self.superseded += 1
        self._m["superseded"].inc()
        log.warning("checkpoint_superseded", job=self.job, step=job.step, why=why)
        _close_spool(job)

    def _loop(self) -> None:
        if self.background_nice:
            try:  # Linux: per-thread nice, so pickling/hashing yields the CPU to training
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.background_nice)
            except (AttributeError, OSError):
                pass
        while True:
            with self._cond:
                while self._pending is None and not self._stopping:
                    self._cond.wait()
                if self._pending is None:
                    return
                job, self._pending = self._pending, None
                self._inflight = job
            try:
                self._run(job)
            finally:
                _close_spool(job)
                with self._cond:
                    self._inflight = None
                    self._cond.notify_all()

    def _run(self, job: _Job) -> None:
        while True:
            job.attempts += 1
            t0 = time.perf_counter()
            try:
                manifest = self._upload(job, t0)
            except Exception as exc:  # noqa: BLE001 - never let an upload error reach training
                self.failures += 1
                self.last_error = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
                self._m["upload_failures"].inc()
                delay = min(self.retry_max_s, self.retry_initial_s * 2 ** min(job.attempts - 1, 16))
                delay *= 0.5 + random.random() / 2
                # Permanent-looking errors (denied, no bucket) are still retried: roles and policies
                # get fixed while training runs, but they are logged as errors.
                permanent = not (is_transient(exc) or isinstance(exc, VerifyError))
                (log.error if permanent else log.warning)(
                    "checkpoint_upload_failed", job=self.job, step=job.step, attempt=job.attempts,
                    retry_in_s=round(delay, 2), error=self.last_error, permanent=permanent)
                with self._cond:
                    end = time.monotonic() + delay
                    while self._pending is None and not self._abort and time.monotonic() < end:
                        self._cond.wait(end - time.monotonic())
                    if self._pending is not None:
                        self._drop(job, "upload failed and a newer snapshot is waiting")
                        return
                    if self._abort:
                        log.error("checkpoint_abandoned", job=self.job, step=job.step, attempts=job.attempts)
                        return
                continue
            self.failures, self.last_error = 0, None
            self._landed(manifest)
            return

    def _upload(self, job: _Job, t0: float) -> Manifest:
        if job.spool is None:  # serialize once; retries re-upload the same bytes
            assert job.ckpt is not None
            job.fields = _fields(job.ckpt)
            spool = tempfile.SpooledTemporaryFile(max_size=self.spool_max_bytes, prefix="elasticyolo-ckpt-")
            writer = _HashingWriter(spool)  # hash while writing: one pass over the bytes, not two
            self._serialize(job.ckpt, writer)  # type: ignore[arg-type]
            spool.flush()
            job.sha256, job.size = writer.sha.hexdigest(), writer.size
            job.spool, job.ckpt = spool, None  # drop the tensors: only the bytes are needed now
        key = layout.object_key(self.job, job.name)
        self.store.put_file(key, job.spool, job.size, metadata={"sha256": job.sha256, "step": str(job.step)})
        self._verify(key, job)
        f = job.fields
        manifest = Manifest(
            job=self.job, key=key, step=job.step, epoch=f.get("epoch", job.epoch), epoch_step=f.get("epoch_step", 0),
            epoch_end=f.get("epoch_end", job.reason == "epoch_end"), world_size=f.get("world_size", 1),
            policy=f.get("policy"), sha256=job.sha256, size=job.size, created=time.time(), reason=job.reason,
            snapshot_s=round(job.snapshot_s, 6), upload_s=round(time.perf_counter() - t0, 4),
            elasticyolo_version=ELASTICYOLO_VERSION, ultralytics_version=f.get("ultralytics_version", ""),
            torch_version=f.get("torch_version", ""),
        )
        try:
            self.store.put_bytes(manifest.manifest_key, manifest.to_json(), if_none_match=True,
                                 content_type="application/json")
        except PreconditionFailed:  # our own earlier attempt landed but its answer was lost
            existing = Manifest.from_json(self.store.get_bytes(manifest.manifest_key))
            if existing.sha256 != job.sha256:
                raise VerifyError(f"{manifest.manifest_key} exists with another sha256") from None
            manifest = existing
        # Only now does "latest" move: the object is complete and verified, the manifest exists.
        current = catalog.read_latest(self.store, self.job)
        if current is not None and current.step > manifest.step and current.created > job.taken_at:
            # Someone (a newer rank 0 after a resize) landed a newer checkpoint while we uploaded.
            log.warning("checkpoint_latest_kept", job=self.job, step=manifest.step, latest_step=current.step)
        else:
            self.store.put_bytes(layout.latest_key(self.job), manifest.to_json(), content_type="application/json")
        return manifest

    def _verify(self, key: str, job: _Job) -> None:
        info = self.store.head(key)
        if info is None:
            raise VerifyError(f"{key} is missing after upload")
        if info.size != job.size:
            raise VerifyError(f"{key} has {info.size} bytes, uploaded {job.size}")
        if self.verify == "head":
            if info.metadata.get("sha256") == job.sha256:
                return  # size + our sha256 metadata; S3 checked the bytes with its own upload checksum
            if not getattr(self.store, "supports_metadata", True):
                return  # file://: written to a temp file, fsynced and renamed; the size is the check
        with tempfile.SpooledTemporaryFile(max_size=self.spool_max_bytes) as back:
            self.store.download(key, back)
            sha, size = sha256_of(back)
        if sha != job.sha256 or size != job.size:
            raise VerifyError(f"{key} reads back with sha256 {sha[:12]}.., expected {job.sha256[:12]}..")

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
        try:
            catalog.prune(self.store, self.job, keep_last=self.keep_last, keep_epochs=self.keep_epochs,
                          orphan_grace_s=self.orphan_grace_s)
        except (Exception, NotFound) as exc:  # noqa: BLE001 - retention is best effort
            log.warning("checkpoint_prune_failed", job=self.job, error=f"{type(exc).__name__}: {exc}"[:300])


class _HashingWriter:
    """The write side of a file that hashes and counts what passes through."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def write(self, data: bytes) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()

    def tell(self) -> int:
        return self.size


def _close_spool(job: _Job) -> None:
    if job.spool is not None:
        try:
            job.spool.close()
        except OSError:
            pass
        job.spool = None
    job.ckpt = None
