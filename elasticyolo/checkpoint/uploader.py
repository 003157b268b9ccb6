"""The checkpoint uploader process: everything a checkpoint costs after the snapshot.

One per `CheckpointManager`, forked from the fork server (`elasticyolo.mp`) and run at a low
priority. It receives a job (the snapshot's structure and the shared-memory slot holding its
tensors, see `shipping.py`), rebuilds the checkpoint dict over the slot (with the EMA module
around the EMA state, `format.assemble`), serializes it while hashing it (sha256, one pass) into
a spool that refers to the tensors' bytes in the slot instead of copying them (`spool.py`),
uploads it straight from there, verifies the stored object, releases the slot, writes the
manifest (conditional put: never overwritten) and only then moves `latest.json`, then applies
retention. Failed uploads are retried with backoff until they land
or a newer job arrives. It tells the manager what happens (events and log records) over a pipe;
training never waits for any of it.
"""

from __future__ import annotations

import collections
import gc
import os
import random
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Mapping, Sequence

from elasticyolo import __version__ as ELASTICYOLO_VERSION
from elasticyolo.checkpoint import catalog, layout
from elasticyolo.checkpoint.hashing import HashingWriter, sha256_of
from elasticyolo.checkpoint.layout import Manifest
from elasticyolo.checkpoint.spool import SegmentSpool
from elasticyolo.checkpoint.stores import NotFound, PreconditionFailed, Store
from elasticyolo.checkpoint.stores.retry import is_transient

Serializer = Callable[[Mapping[str, Any], IO[bytes]], None]
Emit = Callable[..., None]


class VerifyError(Exception):
    """The stored object does not match what was uploaded."""


def torch_serialize(ckpt: Mapping[str, Any], out: IO[bytes]) -> None:
    from elasticyolo.checkpoint.format import serialize

    serialize(ckpt, out)


@dataclass
class UploadOptions:
    keep_last: int = 3
    keep_epochs: bool = False
    verify: str = "head"
    retry_initial_s: float = 1.0
    retry_max_s: float = 60.0
    orphan_grace_s: float = 3600.0
    spool_max_bytes: int = 512 * 1024 * 1024


@dataclass
class Job:
    """What the manager sends (the snapshot travels separately, in the slot)."""

    id: int
    step: int
    epoch: int
    reason: str
    snapshot_s: float
    name: str
    taken_at: float


@dataclass
class _Work:
    job: Job
    ckpt: Mapping[str, Any] | None
    spool: SegmentSpool | None = None  # serialized bytes (mostly references into the slot), kept across retries
    sha256: str = ""
    size: int = 0
    fields: dict[str, Any] = field(default_factory=dict)
    attempts: int = 0
    serialize_s: float = 0.0


class Uploader:
    """The job pipeline (no process or pipe handling: `main` drives it)."""

    def __init__(self, store: Store, job_name: str, opts: UploadOptions, serializer: Serializer | None,
                 emit: Emit) -> None:
        self.store, self.job_name, self.opts = store, layout.check_job(job_name), opts
        self.serialize = serializer or torch_serialize
        self.emit = emit
        self._spool = SegmentSpool()
        self.latest_name: str | None = None  # what `latest` points to after our last upload
        self._orphans_checked = float("-inf")  # monotonic time of the last look for orphans

    def log(self, level: str, event: str, **fields: Any) -> None:
        self.emit("log", level, event, fields)

    def serialize_once(self, work: _Work, slot: Sequence[memoryview]) -> None:
        """Serialize `work.ckpt` into the spool, hashing as it goes (one pass over the bytes, not
        two); every attempt uploads these bytes. Tensor bytes that lie in `slot` stay there (the
        spool refers to them): the slot must not change until the spool is closed."""
        assert work.ckpt is not None and work.spool is None
        from elasticyolo.checkpoint.format import manifest_fields

        t0 = time.perf_counter()
        work.fields = manifest_fields(work.ckpt)
        spool = self._spool.reset(slot)
        writer = HashingWriter(spool)
        buffered = writer.buffered()
        self.serialize(work.ckpt, buffered)
        buffered.flush()
        work.sha256, work.size = writer.sha.hexdigest(), writer.size
        work.spool, work.ckpt = spool, None  # only the bytes are needed now
        work.serialize_s = time.perf_counter() - t0

    def attempt(self, work: _Work) -> Manifest:
        work.attempts += 1
        t0 = time.perf_counter() - (work.serialize_s if work.attempts == 1 else 0.0)
        assert work.spool is not None, "serialize_once first"
        job = work.job
        key = layout.object_key(self.job_name, job.name)
        self.store.put_file(key, work.spool, work.size, metadata={"sha256": work.sha256, "step": str(job.step)},
                            sha256=work.sha256)
        self._verify(key, work)
        f = work.fields
        manifest = Manifest(
            job=self.job_name, key=key, step=job.step, epoch=f.get("epoch", job.epoch),
            epoch_step=f.get("epoch_step", 0), epoch_end=f.get("epoch_end", job.reason == "epoch_end"),
            world_size=f.get("world_size", 1), policy=f.get("policy"), sha256=work.sha256, size=work.size,
            created=time.time(), reason=job.reason, snapshot_s=round(job.snapshot_s, 6),
            upload_s=round(time.perf_counter() - t0, 4), elasticyolo_version=ELASTICYOLO_VERSION,
            ultralytics_version=f.get("ultralytics_version", ""), torch_version=f.get("torch_version", ""),
        )
        try:
            self.store.put_bytes(manifest.manifest_key, manifest.to_json(), if_none_match=True,
                                 content_type="application/json")
        except PreconditionFailed:  # our own earlier attempt landed but its answer was lost
            existing = Manifest.from_json(self.store.get_bytes(manifest.manifest_key))
            if existing.sha256 != work.sha256:
                raise VerifyError(f"{manifest.manifest_key} exists with another sha256") from None
            manifest = existing
        # Only now does "latest" move: the object is complete and verified, the manifest exists.
        current = catalog.read_latest(self.store, self.job_name)
        if current is not None and current.step > manifest.step and current.created > job.taken_at:
            # Someone (a newer rank 0 after a resize) landed a newer checkpoint while we uploaded.
            self.log("warning", "checkpoint_latest_kept", job=self.job_name, step=manifest.step,
                     latest_step=current.step)
            self.latest_name = current.name
        else:
            self.store.put_bytes(layout.latest_key(self.job_name), manifest.to_json(),
                                 content_type="application/json")
            self.latest_name = manifest.name
        return manifest

    def _verify(self, key: str, work: _Work) -> None:
        info = self.store.head(key)
        if info is None:
            raise VerifyError(f"{key} is missing after upload")
        if info.size != work.size:
            raise VerifyError(f"{key} has {info.size} bytes, uploaded {work.size}")
        if self.opts.verify == "head":
            if info.metadata.get("sha256") == work.sha256:
                return  # size + our sha256 metadata; S3 checked the bytes with its own upload checksum
            if not getattr(self.store, "supports_metadata", True):
                return  # file://: written to a temp file, fsynced and renamed; the size is the check
        with tempfile.SpooledTemporaryFile(max_size=self.opts.spool_max_bytes) as back:
            self.store.download(key, back)
            sha, size = sha256_of(back)
        if sha != work.sha256 or size != work.size:
            raise VerifyError(f"{key} reads back with sha256 {sha[:12]}.., expected {work.sha256[:12]}..")

    def prune(self) -> None:
        """After each landed checkpoint. Orphans (objects whose manifest was never written) are
        looked for at most every quarter of their grace period: that is a listing of every
        object, and they are rare (an uploader killed between object and manifest)."""
        now = time.monotonic()
        orphans = now - self._orphans_checked >= self.opts.orphan_grace_s / 4
        try:
            catalog.prune(self.store, self.job_name, keep_last=self.opts.keep_last, keep_epochs=self.opts.keep_epochs,
                          orphan_grace_s=self.opts.orphan_grace_s, latest_name=self.latest_name, orphans=orphans)
            if orphans:
                self._orphans_checked = now
        except (Exception, NotFound) as exc:  # noqa: BLE001 - retention is best effort
            self.log("warning", "checkpoint_prune_failed", job=self.job_name,
                     error=f"{type(exc).__name__}: {exc}"[:300])

    def retry_delay(self, work: _Work) -> float:
        delay = min(self.opts.retry_max_s, self.opts.retry_initial_s * 2 ** min(work.attempts - 1, 16))
        return delay * (0.5 + random.random() / 2)


def close_spool(work: _Work) -> None:
    """Drop the job's bytes (the spool is kept for the next one): its slot can be released."""
    if work.spool is not None:
        work.spool.close()
    work.spool = work.ckpt = None


def yield_cpu(nice: int) -> None:
    """Make this whole process yield the CPU to training: `nice`, and at 19 also Linux's
    SCHED_IDLE class (runs only on CPU time nothing else wants; nice 19 alone still takes about
    1.5 % of a busy core per runnable thread, which shows as a few % of training throughput on a
    2-core node: bench/checkpoint_stall.py)."""
    try:
        os.nice(nice)
    except OSError:
        pass
    if nice >= 19 and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]


def main(conn: Any, store_bytes: bytes, job_name: str, opts: UploadOptions, serializer: Serializer | None,
         nice: int, env: dict[str, str]) -> None:
    """The process: take jobs from `conn` until "stop" or orphaned."""
    import pickle

    from elasticyolo.checkpoint import shipping
    from elasticyolo.checkpoint.format import assemble
    from elasticyolo.mp import ParentWatch, adopt_environment, single_threaded

    adopt_environment(env)  # store credentials and endpoints as the training process has them now
    single_threaded()
    import torch

    # No zip CRC32 per record: the manifest's sha256 covers every byte of the file (S3 checks it
    # on upload, restore before loading), and the CRC was another pass over the bytes, 40 % of
    # torch.save's time. torch.load reads such files as usual.
    torch.serialization.set_crc32_options(False)
    # What the process inherited lives as long as it does: out of the collector's sight, so the
    # collections that building and pickling each checkpoint's module trigger do not walk all of
    # torch's objects every time (again after the first job: its unpickling imports the model's
    # classes).
    gc.freeze()
    frozen_after_first = False
    if nice:
        yield_cpu(nice)
    watch = ParentWatch()
    watch.exit_with_owner()  # even mid-upload: an upload cut short never gets a manifest
    store = pickle.loads(store_bytes)

    def emit(*msg: Any) -> None:
        conn.send(msg)

    up = Uploader(store, job_name, opts, serializer, emit)

    def receive(timeout: float | None) -> Any:
        """The next message, or None on timeout; ("stop", True) when the owner is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
            if left <= 0:
                return None
            try:
                if conn.poll(left):
                    return conn.recv()
            except (EOFError, OSError):
                return ("stop", True)
            if not watch.alive():
                return ("stop", True)

    # The last two jobs' slot buffers (the manager alternates two slots) stay referenced, so
    # torch's shared-storage cache maps a slot that comes again to the same, already faulted-in
    # memory instead of mapping it anew each checkpoint.
    mapped: collections.deque[list[Any]] = collections.deque(maxlen=2)
    msg = receive(None)
    while msg is not None and msg[0] == "job":
        _, job, buffers, skeleton = msg
        mapped.append(buffers)
        emit("started", job.id)
        work = _Work(job, None)
        # The checkpoint's tensors are views of the slot and the spool refers to their bytes
        # there, so the slot stays this job's until its upload is over (landed or given up);
        # the manager's other slot takes snapshots meanwhile.
        try:
            work.ckpt = assemble(shipping.loads(skeleton, buffers))
            up.serialize_once(work, shipping.byte_views(buffers))
        except Exception as exc:  # noqa: BLE001 - a bad snapshot skips one checkpoint
            close_spool(work)
            emit("released", job.id)
            emit("dropped", job.id, f"snapshot not serializable: {_one_line(exc)}")
            msg = receive(None)
            continue
        msg = None
        while True:
            try:
                manifest = up.attempt(work)
            except Exception as exc:  # noqa: BLE001 - never let an upload error reach training
                error = _one_line(exc)
                delay = up.retry_delay(work)
                # Permanent-looking errors (denied, no bucket) are still retried: roles and policies
                # get fixed while training runs, but they are logged as errors.
                permanent = not (is_transient(exc) or isinstance(exc, VerifyError))
                emit("failed", job.id, error, work.attempts, round(delay, 2), permanent)
                msg = receive(delay)
                if msg is None:
                    continue  # retry
                close_spool(work)
                emit("released", job.id)  # before the outcome: the manager frees the slot first
                if msg[0] == "job":
                    emit("dropped", job.id, "upload failed and a newer snapshot is waiting")
                elif msg[1]:  # stop, abandoning this one
                    emit("dropped", job.id, "abandoned")
                break
            close_spool(work)
            emit("released", job.id)
            emit("landed", job.id, manifest.to_json())
            up.prune()
            break
        if not frozen_after_first:
            gc.collect()
            gc.freeze()
            frozen_after_first = True
        if msg is None:
            msg = receive(None)
