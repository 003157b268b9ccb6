"""Datasets and weights from S3, staged into a node-local cache.

`data=s3://bucket/prefix/data.yaml`: the dataset is every object under the data.yaml's
"directory" (`s3://bucket/prefix/`); its copy lives in the cache (cache.py) and a
rewritten data.yaml points Ultralytics at it. `model=` or `pretrained=s3://bucket/key.pt`: the
weights are that one object, staged the same way and used as a local `.pt`.

* Parallel: small objects through boto3's transfer manager (`max_concurrency` requests at
  once); objects of `large_object_bytes` or more in `segment_bytes` ranges fetched in parallel.
* Verified: every object's size, and its MD5 against the ETag (multipart ETags too: the part size
  comes from `HeadObject(PartNumber=1)`). Objects whose ETag is no MD5 (SSE-KMS, SSE-C) are checked
  against their full-object checksum (SHA-256, SHA-1, CRC32) when they have one, else by size.
  Downloads pin the version they listed (`If-Match: <etag>`). A corrupt copy is fetched again, up
  to `attempts` times, then staging fails naming the object.
* Resumable: verified objects are journaled; a killed staging resumes where it stopped, and a
  large object resumes at its first missing segment.
* Capped: before downloading, least recently used datasets that no job uses are evicted to stay
  under the cache cap (and within the free disk space).
* Reused: a dataset whose S3 listing (keys, sizes, ETags) is unchanged is used as it is; a changed
  one only fetches what changed.

Who stages: the agent (agent/staging.py) before it offers the node's slots to a job; a worker
started by an agent only waits for that (`resolve_staged`); a single
process (`elasticyolo train`, `elasticyolo data stage`) stages itself. Only boto3/s3transfer here, no torch.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import queue
import re
import shutil
import threading
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from elasticyolo.errors import UnavailableError, UserError
from elasticyolo.staging.cache import CacheEntry, DatasetCache, DatasetLock, GiB, Journal, default_cache_root
from elasticyolo.weights_file import check_weights_file

MiB = 1024 * 1024
STAGER_ENV = "ELASTICYOLO_DATA_STAGER"  # "agent": workers wait for their agent instead of staging
_MD5 = re.compile(r"^[0-9a-f]{32}$")
_MULTIPART = re.compile(r"^([0-9a-f]{32})-(\d+)$")


class StagingError(UserError):
    """The dataset could not be staged (corrupt object, access denied, bad data.yaml, ...)."""


class StagingCancelled(Exception):
    """stage() was cancelled (the node is draining)."""


def is_remote(data: str) -> bool:
    return str(data).startswith("s3://")


WEIGHTS_SUFFIX = ".pt"


def is_weights_uri(uri: str) -> bool:
    """An `s3://` URI naming one weights file (staged alone) rather than a dataset's data.yaml."""
    return is_remote(uri) and str(uri).endswith(WEIGHTS_SUFFIX)


@dataclass(frozen=True)
class SourceRef:
    """What one `s3://` URI stages: a dataset (every object under its data.yaml's prefix) or a
    weights file (that object alone)."""

    uri: str
    bucket: str
    prefix: str  # "" or "a/b" (no trailing slash): the folder of the object the URI names
    main_key: str  # that object's key relative to prefix: the data.yaml, or the weights file
    kind: str = "dataset"  # "dataset" or "weights"

    @classmethod
    def parse(cls, uri: str) -> "SourceRef":
        """A weights file when the URI ends in `.pt`, else a dataset's data.yaml."""
        from elasticyolo.checkpoint.stores.s3 import valid_bucket_name

        kind = "weights" if str(uri).endswith(WEIGHTS_SUFFIX) else "dataset"
        expected = "s3://bucket/key.pt" if kind == "weights" else "s3://bucket/prefix/data.yaml"
        rest = uri.removeprefix("s3://")
        bucket, _, key = rest.partition("/")
        if not uri.startswith("s3://") or not bucket or not key or key.endswith("/"):
            raise UserError(f"{kind} {uri!r}: expected {expected}")
        if not valid_bucket_name(bucket):
            raise UserError(f"{kind} {uri!r}: {bucket!r} is not a valid S3 bucket name")
        if kind == "dataset" and not key.endswith((".yaml", ".yml")):
            raise UserError(f"dataset {uri!r}: name the dataset's data.yaml (s3://bucket/prefix/data.yaml)")
        prefix, _, name = key.rpartition("/")
        return cls(uri, bucket, prefix, name, kind)

    def full_key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    @property
    def list_prefix(self) -> str:
        """What to list: the dataset's folder, or the weights file's own key."""
        if self.kind == "weights":
            return self.full_key(self.main_key)
        return f"{self.prefix}/" if self.prefix else ""

    def wanted(self, rel: str) -> bool:
        """Is listed object `rel` part of what this URI stages?"""
        return self.kind == "dataset" or rel == self.main_key

    def local(self, entry: CacheEntry) -> Path:
        """The file a job uses: the rewritten data.yaml, or the weights file."""
        return entry.data_yaml if self.kind == "dataset" else entry.local_path(self.main_key)


@dataclass(frozen=True)
class RemoteObject:
    key: str  # relative to the dataset prefix
    size: int
    etag: str  # without quotes


@dataclass
class StageProgress:
    phase: str  # listing, downloading, ready
    files_total: int = 0
    bytes_total: int = 0
    files_done: int = 0
    bytes_done: int = 0
    downloaded_bytes: int = 0
    started: float = field(default_factory=time.monotonic)

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


@dataclass
class StageResult:
    uri: str
    path: Path  # what a job uses: the rewritten data.yaml, or the weights file
    files: int
    bytes: int
    downloaded_files: int
    downloaded_bytes: int
    seconds: float
    reused: bool  # nothing needed downloading
    evicted: list[str] = field(default_factory=list)
    verified: dict[str, int] = field(default_factory=dict)  # md5 / checksum / size-only counts
    offline: bool = False  # S3 unreachable: an earlier complete copy was used unchecked

    def as_record(self) -> dict[str, Any]:
        return {"files": self.files, "bytes": self.bytes, "downloaded_files": self.downloaded_files,
                "downloaded_bytes": self.downloaded_bytes, "seconds": round(self.seconds, 3), "reused": self.reused,
                "evicted": self.evicted, "verified": self.verified, "offline": self.offline}


def s3_client(options: dict[str, Any] | None, max_concurrency: int) -> Any:
    """A boto3 S3 client for staging (standard chain; botocore retries transient errors)."""
    import boto3
    import botocore.config
    import botocore.exceptions as bce

    options = options or {}
    try:
        session = boto3.session.Session(profile_name=options.get("profile"), region_name=options.get("region"))
    except bce.ProfileNotFound as exc:
        raise UserError(f"dataset staging: {exc}") from None
    cfg = botocore.config.Config(retries={"mode": "standard", "max_attempts": 8}, connect_timeout=10,
                                 read_timeout=60, max_pool_connections=2 * max_concurrency + 4)
    return session.client("s3", endpoint_url=options.get("endpoint_url"), config=cfg)


def listing_digest(objects: list[RemoteObject]) -> str:
    h = hashlib.sha256()
    for o in sorted(objects, key=lambda o: o.key):
        h.update(f"{o.key}\t{o.size}\t{o.etag}\n".encode())
    return h.hexdigest()


def _subscriber_base() -> type:
    from s3transfer.subscribers import BaseSubscriber

    return BaseSubscriber  # type: ignore[no-any-return]


class _Known(_subscriber_base()):  # type: ignore[misc]
    """s3transfer subscriber: size and ETag are known from the listing (no HEAD per object; the
    ETag makes every GET conditional on the version we listed)."""

    def __init__(self, obj: RemoteObject, done: Callable[[Any], None]) -> None:
        self.obj, self._done = obj, done

    def on_queued(self, future: Any, **_kw: Any) -> None:
        future.meta.provide_transfer_size(self.obj.size)
        future.meta.provide_object_etag(f'"{self.obj.etag}"')

    def on_done(self, future: Any, **_kw: Any) -> None:
        self._done(future)


class Stager:
    def __init__(self, cache: DatasetCache, options: dict[str, Any] | None = None, *, max_concurrency: int = 16,
                 large_object_bytes: int = 64 * MiB, segment_bytes: int = 16 * MiB, attempts: int = 3,
                 progress: Callable[[StageProgress], None] | None = None, cancel: threading.Event | None = None,
                 client: Any = None, log: Any = None) -> None:
        self.cache, self.options = cache, dict(options or {})
        self.max_concurrency = max_concurrency
        self.large_object_bytes, self.segment_bytes = large_object_bytes, segment_bytes
        self.attempts = attempts
        self._progress_cb = progress
        self.cancel = cancel or threading.Event()
        self._client = client
        self.log = log or _log()
        self._last_progress = 0.0
        self._part_sizes: dict[str, int] = {}

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = s3_client(self.options, self.max_concurrency)
        return self._client

    # ---- the whole run ------------------------------------------------------------------
    def stage(self, uri: str) -> StageResult:
        """Make the local copy match S3. Checking an unchanged copy needs only a shared lock (jobs
        keep training on it); changing it waits for an exclusive one (no job uses it then)."""
        ref = SourceRef.parse(uri)
        entry = self.cache.entry(uri)
        lock = DatasetLock(entry)
        progress = StageProgress("listing")
        try:
            if not lock.acquire(exclusive=False, cancelled=self.cancel.is_set):
                raise StagingCancelled(uri)
            self._report(progress, force=True)
            try:
                objects = self._list(ref)
            except UnavailableError as exc:
                offline = self._offline_copy(ref, entry, progress, exc)
                if offline is None:
                    raise
                return offline
            if not any(o.key == ref.main_key for o in objects):
                raise StagingError(f"{ref.kind} {ref.uri}: no such object")
            reused = self._reuse(ref, entry, objects, progress)
            if reused is not None:
                return reused
            lock.release()
            if not lock.acquire(exclusive=True, timeout=1.0):
                self.log.info("waiting for the jobs using the old copy to end", source=ref.uri)
                if not lock.acquire(exclusive=True, cancelled=self.cancel.is_set):
                    raise StagingCancelled(uri)
            # Another stager may have finished while we waited.
            return self._reuse(ref, entry, objects, progress) or self._stage_locked(ref, entry, objects, progress)
        finally:
            lock.close()

    def _offline_copy(self, ref: SourceRef, entry: CacheEntry, progress: StageProgress,
                      exc: Exception) -> StageResult | None:
        """S3 unreachable: a complete earlier copy is used (with a warning), else None."""
        meta = entry.read_meta()
        if meta.get("state") == "ready" and meta.get("uri") == ref.uri and ref.local(entry).is_file():
            self.log.warning("S3 unreachable; using the staged copy without checking for changes",
                             source=ref.uri, error=str(exc))
            entry.write_meta(last_used=time.time())
            return StageResult(ref.uri, ref.local(entry), int(meta.get("files", 0)), int(meta.get("bytes", 0)),
                               0, 0, progress.seconds, True, offline=True)
        return None

    def _reuse(self, ref: SourceRef, entry: CacheEntry, objects: list[RemoteObject],
               progress: StageProgress) -> StageResult | None:
        """The copy as it is, when it is complete and S3's listing has not changed since."""
        digest = listing_digest(objects)
        total = sum(o.size for o in objects)
        progress.files_total, progress.bytes_total = len(objects), total
        meta = entry.read_meta()
        if not (meta.get("state") == "ready" and meta.get("digest") == digest and ref.local(entry).is_file()
                and all(self._present(entry, o) for o in objects)):
            return None
        entry.write_meta(last_used=time.time())
        progress.phase, progress.files_done, progress.bytes_done = "ready", len(objects), total
        self._report(progress, force=True)
        self.log.info(f"{ref.kind} reused", source=ref.uri, files=len(objects), bytes=total,
                      seconds=round(progress.seconds, 3))
        return StageResult(ref.uri, ref.local(entry), len(objects), total, 0, 0, progress.seconds, True,
                           verified=dict(meta.get("verified") or {}))

    def _stage_locked(self, ref: SourceRef, entry: CacheEntry, objects: list[RemoteObject],
                      progress: StageProgress) -> StageResult:
        digest = listing_digest(objects)
        total = sum(o.size for o in objects)
        # What is already here (journaled, or complete but unjournaled after a crash).
        journal = entry.journal()
        todo: list[RemoteObject] = []
        present = 0
        verified: dict[str, int] = {}
        recovered: list[RemoteObject] = []
        for o in objects:
            if journal.get(o.key) == (o.size, o.etag) and self._present(entry, o):
                present += o.size
            elif self._present(entry, o) and self._verify(ref, o, entry.local_path(o.key))[0] is None:
                recovered.append(o)
                present += o.size
            else:
                todo.append(o)
        evicted = self.cache.make_room(entry, total, present, self.log)
        entry.write_meta(uri=ref.uri, state="staging", files=len(objects), bytes=total, digest=None,
                         started_at=time.time(), error=None, last_used=time.time())
        shutil.rmtree(entry.tmp, ignore_errors=True)
        entry.tmp.mkdir(parents=True, exist_ok=True)
        entry.files.mkdir(parents=True, exist_ok=True)
        listed = {o.key for o in objects}
        for stale in set(journal) - listed:  # deleted or renamed in S3 since the last staging
            try:
                entry.local_path(stale).unlink(missing_ok=True)
            except ValueError:
                pass
        jr = Journal(entry)
        try:
            for o in recovered:
                jr.add(o.key, o.size, o.etag)
            progress.phase = "downloading"
            progress.files_done, progress.bytes_done = len(objects) - len(todo), present
            self.log.info(f"staging {ref.kind}", source=ref.uri, files=len(objects), bytes=total, to_fetch=len(todo),
                          fetch_bytes=sum(o.size for o in todo), cache=str(entry.dir))
            self._download_all(ref, entry, todo, jr, progress, verified)
            if ref.kind == "weights":
                check_weights_file(ref.local(entry), f"weights {ref.uri}", StagingError)
        except BaseException as exc:
            if not isinstance(exc, StagingCancelled):
                entry.write_meta(state="failed", error=str(exc)[:500])
            raise
        finally:
            jr.close()
        if ref.kind == "dataset":
            self._write_data_yaml(ref, entry)
        shutil.rmtree(entry.tmp, ignore_errors=True)
        seconds = progress.seconds
        entry.write_meta(state="ready", digest=digest, completed_at=time.time(), seconds=round(seconds, 3),
                         last_used=time.time(), verified=verified, error=None)
        progress.phase = "ready"
        self._report(progress, force=True)
        result = StageResult(ref.uri, ref.local(entry), len(objects), total, len(todo),
                             sum(o.size for o in todo), seconds, not todo, evicted, verified)
        self.log.info(f"{ref.kind} staged", source=ref.uri, **result.as_record())
        return result

    # ---- listing --------------------------------------------------------------------------
    def _list(self, ref: SourceRef) -> list[RemoteObject]:
        prefix = f"{ref.prefix}/" if ref.prefix else ""
        out: list[RemoteObject] = []
        skipped: list[str] = []
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=ref.bucket,
                                                                              Prefix=ref.list_prefix):
                if self.cancel.is_set():
                    raise StagingCancelled(ref.uri)
                for item in page.get("Contents", []):
                    rel = str(item["Key"])[len(prefix):]
                    if rel.endswith("/") or not ref.wanted(rel):
                        continue  # a "directory" marker, or a neighbour of a weights file
                    try:
                        CacheEntry(Path("/"), "x").local_path(rel)
                    except ValueError:
                        skipped.append(rel)
                        continue
                    out.append(RemoteObject(rel, int(item["Size"]), str(item.get("ETag", "")).strip('"')))
        except StagingCancelled:
            raise
        except Exception as exc:  # noqa: BLE001 - one line below
            raise self._explain(ref, exc) from None
        if skipped:
            self.log.warning("objects with unsafe names skipped", source=ref.uri, count=len(skipped),
                             example=skipped[0])
        return out

    # ---- downloads --------------------------------------------------------------------------
    def _download_all(self, ref: SourceRef, entry: CacheEntry, todo: list[RemoteObject], jr: Journal,
                      progress: StageProgress, verified: dict[str, int]) -> None:
        from s3transfer.manager import TransferConfig, TransferManager

        small = [o for o in todo if o.size < self.large_object_bytes]
        large = [o for o in todo if o.size >= self.large_object_bytes]
        results: "queue.Queue[tuple[RemoteObject, Path, BaseException | None]]" = queue.Queue()
        attempts: dict[str, int] = {}
        config = TransferConfig(max_request_concurrency=self.max_concurrency,
                                multipart_threshold=self.large_object_bytes, num_download_attempts=3)
        tm = TransferManager(self.client, config)
        segments = ThreadPoolExecutor(max_workers=self.max_concurrency, thread_name_prefix="stage-seg")
        pending = 0

        def submit(o: RemoteObject) -> None:
            nonlocal pending
            attempts[o.key] = attempts.get(o.key, 0) + 1
            pending += 1
            if o.size >= self.large_object_bytes:
                threading.Thread(target=self._fetch_large, args=(ref, entry, o, segments, results),
                                 name="stage-large", daemon=True).start()
                return
            tmp = entry.tmp / uuid.uuid4().hex

            def done(future: Any, o: RemoteObject = o, tmp: Path = tmp) -> None:
                try:
                    future.result()
                    err: BaseException | None = None
                except BaseException as exc:  # noqa: BLE001 - reported to the main thread
                    err = exc
                results.put((o, tmp, err))

            tm.download(ref.bucket, ref.full_key(o.key), str(tmp), subscribers=[_Known(o, done)])

        try:
            for o in large:
                submit(o)
            queue_ahead = iter(small)
            # Keep a bounded number of requests queued: the transfer manager blocks when full.
            for o in _take(queue_ahead, 4 * self.max_concurrency):
                submit(o)
            while pending:
                if self.cancel.is_set():
                    raise StagingCancelled(ref.uri)
                try:
                    o, tmp, err = results.get(timeout=0.25)
                except queue.Empty:
                    self._report(progress)
                    continue
                pending -= 1
                reason, kind = self._failure(ref, o, tmp, err)
                if reason is None:
                    final = entry.local_path(o.key)
                    final.parent.mkdir(parents=True, exist_ok=True)
                    os.replace(tmp, final)
                    jr.add(o.key, o.size, o.etag)
                    verified[kind] = verified.get(kind, 0) + 1
                    progress.files_done += 1
                    progress.bytes_done += o.size
                    progress.downloaded_bytes += o.size
                else:
                    tmp.unlink(missing_ok=True)
                    if attempts[o.key] >= self.attempts:
                        raise StagingError(f"{ref.kind} {ref.uri}: {o.key}: {reason} "
                                           f"(after {attempts[o.key]} downloads)")
                    self.log.warning("object failed verification; fetching it again", source=ref.uri, key=o.key,
                                     reason=reason, attempt=attempts[o.key])
                    submit(o)
                for nxt in _take(queue_ahead, 1):
                    submit(nxt)
                self._report(progress)
        finally:
            cancel = self.cancel.is_set() or pending > 0
            tm.shutdown(cancel=cancel)
            segments.shutdown(wait=True, cancel_futures=True)

    def _failure(self, ref: SourceRef, o: RemoteObject, tmp: Path, err: BaseException | None
                 ) -> tuple[str | None, str]:
        """(why this download is unusable or None, how it was verified). Raises for errors that
        another download cannot fix (access denied, the object changed or is gone)."""
        import botocore.exceptions as bce

        if err is None:
            return self._verify(ref, o, tmp)
        if isinstance(err, StagingCancelled):
            raise err
        name = type(err).__name__
        if "Checksum" in name:  # botocore checked the response's checksum: corrupt in transfer
            return f"corrupt in transfer ({name})", ""
        if isinstance(err, bce.ClientError):
            code = str(err.response.get("Error", {}).get("Code", ""))
            if code in ("PreconditionFailed", "412"):
                raise StagingError(f"{ref.kind} {ref.uri}: {o.key} changed in S3 while staging; stage again") from None
            if code not in ("SlowDown", "503", "500", "InternalError", "ServiceUnavailable", "RequestTimeout"):
                raise self._explain(ref, err, o.key) from None
        return f"transfer failed ({name}: {' '.join(str(err).split())[:200]})", ""

    def _fetch_large(self, ref: SourceRef, entry: CacheEntry, o: RemoteObject, pool: ThreadPoolExecutor,
                     results: "queue.Queue[tuple[RemoteObject, Path, BaseException | None]]") -> None:
        """Ranged GETs into partial/<id>.part; finished segments are journaled in .segments, so an
        interrupted object resumes at its first missing segment."""
        ident = hashlib.sha1(o.key.encode()).hexdigest()
        part, seg_log = entry.partial / f"{ident}.part", entry.partial / f"{ident}.segments"
        try:
            entry.partial.mkdir(parents=True, exist_ok=True)
            header = f"{o.size} {o.etag}"
            done: set[int] = set()
            if part.exists() and seg_log.exists():
                lines = seg_log.read_text().splitlines()
                if lines and lines[0] == header and part.stat().st_size == o.size:
                    done = {int(x) for x in lines[1:] if x.isdigit()}
            if not done:
                seg_log.write_text(header + "\n")
                with open(part, "wb") as fh:
                    fh.truncate(o.size)
            n = (o.size + self.segment_bytes - 1) // self.segment_bytes
            fd = os.open(part, os.O_WRONLY)
            lock = threading.Lock()
            try:
                with open(seg_log, "a") as log_fh:
                    def fetch(i: int) -> int:
                        if self.cancel.is_set():
                            raise StagingCancelled(ref.uri)
                        start = i * self.segment_bytes
                        end = min(o.size, start + self.segment_bytes) - 1
                        body = self.client.get_object(Bucket=ref.bucket, Key=ref.full_key(o.key),
                                                      Range=f"bytes={start}-{end}", IfMatch=f'"{o.etag}"')["Body"]
                        offset = start
                        for chunk in iter(lambda: body.read(MiB), b""):
                            os.pwrite(fd, chunk, offset)
                            offset += len(chunk)
                        if offset != end + 1:
                            raise IOError(f"short segment {i}: {offset - start} of {end + 1 - start} bytes")
                        with lock:
                            os.fsync(fd)
                            log_fh.write(f"{i}\n")
                            log_fh.flush()
                        return i

                    for f in [pool.submit(fetch, i) for i in range(n) if i not in done]:
                        f.result()
            finally:
                os.close(fd)
            tmp = entry.tmp / uuid.uuid4().hex
            os.replace(part, tmp)
            seg_log.unlink(missing_ok=True)
            results.put((o, tmp, None))
        except BaseException as exc:  # noqa: BLE001 - reported to the main thread
            results.put((o, entry.tmp / "missing", exc))

    # ---- verification -----------------------------------------------------------------------
    def _present(self, entry: CacheEntry, o: RemoteObject) -> bool:
        try:
            return entry.local_path(o.key).stat().st_size == o.size
        except (OSError, ValueError):
            return False

    def _verify(self, ref: SourceRef, o: RemoteObject, path: Path) -> tuple[str | None, str]:
        """(None, how) when `path` holds object `o`, else (the reason it does not, "")."""
        try:
            size = path.stat().st_size
        except OSError:
            return "download missing", ""
        if size != o.size:
            return f"size {size} != {o.size}", ""
        etag = o.etag.lower()
        got_md5 = None
        if _MD5.match(etag):
            got_md5 = _md5_of(path)
            if got_md5 == etag:
                return None, "md5"
        elif _MULTIPART.match(etag):
            part_size = self._part_size(ref, o)
            if part_size:
                got_md5 = _multipart_etag(path, part_size)
                if got_md5 == etag:
                    return None, "md5"
        # The ETag is no MD5 for SSE-KMS / SSE-C objects: use a full-object checksum if any.
        head = self._head(ref, o)
        encrypted = head.get("ServerSideEncryption") in ("aws:kms", "aws:kms:dsse") or head.get("SSECustomerAlgorithm")
        for name, fn in (("ChecksumSHA256", _sha256_b64), ("ChecksumSHA1", _sha1_b64), ("ChecksumCRC32", _crc32_b64)):
            value = head.get(name)
            if value and "-" not in str(value) and head.get("ChecksumType", "FULL_OBJECT") == "FULL_OBJECT":
                if fn(path) == value:
                    return None, "checksum"
                return f"{name.removeprefix('Checksum')} mismatch: corrupt copy", ""
        if encrypted or got_md5 is None:
            return None, "size-only"  # nothing else to compare with
        return f"MD5 {got_md5} != ETag {etag}: corrupt copy", ""

    def _head(self, ref: SourceRef, o: RemoteObject) -> dict[str, Any]:
        try:
            return dict(self.client.head_object(Bucket=ref.bucket, Key=ref.full_key(o.key), ChecksumMode="ENABLED"))
        except Exception as exc:  # noqa: BLE001
            raise self._explain(ref, exc, o.key) from None

    def _part_size(self, ref: SourceRef, o: RemoteObject) -> int | None:
        if o.key not in self._part_sizes:
            try:
                head = self.client.head_object(Bucket=ref.bucket, Key=ref.full_key(o.key), PartNumber=1)
                self._part_sizes[o.key] = int(head["ContentLength"])
            except Exception:  # noqa: BLE001 - unknown part size: fall back to checksums/size
                return None
        return self._part_sizes[o.key]

    # ---- data.yaml ----------------------------------------------------------------------------
    def _write_data_yaml(self, ref: SourceRef, entry: CacheEntry) -> None:
        src = entry.local_path(ref.main_key)
        where = f"dataset {ref.uri}"
        try:
            raw = yaml.safe_load(src.read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise StagingError(f"{where}: data.yaml is not valid YAML ({type(exc).__name__})") from None
        if not isinstance(raw, dict):
            raise StagingError(f"{where}: data.yaml must be a mapping with train, val and names")
        for key in ("train", "val", "test", "minival"):
            for item in (raw.get(key) if isinstance(raw.get(key), list) else [raw.get(key)]):
                if item is None:
                    continue
                if not isinstance(item, str) or item.startswith(("/", "s3://")) or ".." in item.split("/"):
                    raise StagingError(f"{where}: '{key}' must be a path inside the dataset's prefix, got {item!r}")
        raw["path"] = str(entry.files)  # the local copy of s3://bucket/prefix/
        raw.pop("download", None)  # never download at run time
        tmp = entry.data_yaml.with_name(f".data.{os.getpid()}.tmp")
        tmp.write_text(yaml.safe_dump(raw, sort_keys=False))
        os.replace(tmp, entry.data_yaml)

    # ---- reporting ----------------------------------------------------------------------------
    def _report(self, progress: StageProgress, force: bool = False) -> None:
        now = time.monotonic()
        if self._progress_cb is not None and (force or now - self._last_progress >= 0.25):
            self._last_progress = now
            self._progress_cb(progress)

    def _explain(self, ref: SourceRef, exc: BaseException, key: str | None = None) -> UserError:
        """A one-line error (UnavailableError for network trouble)."""
        import botocore.exceptions as bce

        where = f"{ref.kind} {ref.uri}" + (f": {key}" if key else "")
        if isinstance(exc, UserError):
            return exc
        if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
            return StagingError(f"{where}: no AWS credentials found (instance role, AWS_PROFILE or s3_profile)")
        if isinstance(exc, (bce.ConnectionError, bce.HTTPClientError, ConnectionError, TimeoutError)):
            return UnavailableError(f"{where}: cannot reach S3 ({type(exc).__name__})")
        if isinstance(exc, bce.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", "")) or "?"
            if code in ("NoSuchBucket",):
                return StagingError(f"{where}: bucket {ref.bucket!r} does not exist")
            if code in ("NoSuchKey", "404"):
                return StagingError(f"{where}: object disappeared while staging; stage again")
            if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
                return StagingError(f"{where}: access denied ({code}); the node's role needs s3:ListBucket on the "
                                    "prefix and s3:GetObject on its objects (deploy/aws/iam-policy.json)")
            if code in ("SlowDown", "503", "500", "InternalError", "ServiceUnavailable", "RequestTimeout"):
                return UnavailableError(f"{where}: S3 is not answering ({code})")
            return StagingError(f"{where}: {code}: {' '.join(str(err.get('Message', '')).split())}")
        return StagingError(f"{where}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")


def _take(it: Iterator[RemoteObject], n: int) -> list[RemoteObject]:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out


def _hash_file(path: Path, h: Any) -> Any:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(4 * MiB), b""):
            h.update(chunk)
    return h


def _md5_of(path: Path) -> str:
    return str(_hash_file(path, hashlib.md5(usedforsecurity=False)).hexdigest())


def _multipart_etag(path: Path, part_size: int) -> str:
    digests = []
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(part_size), b""):
            digests.append(hashlib.md5(chunk, usedforsecurity=False).digest())
    return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"


def _sha256_b64(path: Path) -> str:
    return base64.b64encode(_hash_file(path, hashlib.sha256()).digest()).decode()


def _sha1_b64(path: Path) -> str:
    return base64.b64encode(_hash_file(path, hashlib.sha1(usedforsecurity=False)).digest()).decode()


def _crc32_b64(path: Path) -> str:
    crc = 0
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(4 * MiB), b""):
            crc = zlib.crc32(chunk, crc)
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


def _log() -> Any:
    from elasticyolo.log import get_logger

    return get_logger("elasticyolo.staging")


# ---- the data.yaml a worker or a single process trains on -----------------------------------------
_held: dict[str, tuple[DatasetLock, Path]] = {}  # shared locks kept for the process's life: no eviction


def cache_from_env(environ: dict[str, str] | None = None) -> DatasetCache:
    env = os.environ if environ is None else environ
    max_gb = env.get("ELASTICYOLO_DATA_CACHE_MAX_GB")
    return DatasetCache(default_cache_root(dict(env)), int(float(max_gb) * GiB) if max_gb else None)


def resolve_data_yaml(uri: str, options: dict[str, Any] | None = None, wait_s: float | None = None) -> Path:
    """The local data.yaml of dataset `uri` (see `resolve_staged`)."""
    return resolve_staged(uri, options, wait_s)


def resolve_staged(uri: str, options: dict[str, Any] | None = None, wait_s: float | None = None,
                   option: str | None = None) -> Path:
    """The local file of `uri` (a dataset's rewritten data.yaml, or a weights file), holding a
    shared lock on its copy until the process exits.

    Under an agent (`ELASTICYOLO_DATA_STAGER=agent`) this waits for the agent's staging (up to
    `wait_s`, default `$ELASTICYOLO_DATA_WAIT_S` or an hour) and never contacts S3; otherwise it
    stages `uri` itself first (S3 options: `options`, else `ELASTICYOLO_S3_*`). `option`: the
    spec option that named `uri` (`model`), which errors then name (`model=s3://...: why`)."""
    try:
        return _resolve_staged(uri, options, wait_s)
    except UserError as exc:
        if option is None:
            raise
        message, named = str(exc), f"{option}={uri}"
        for kind in ("weights", "dataset"):  # "weights s3://...: why" -> "model=s3://...: why"
            if message.startswith(f"{kind} {uri}"):
                message = named + message[len(f"{kind} {uri}"):]
        raise type(exc)(message if message.startswith(named) else f"{named}: {message}") from None


def _resolve_staged(uri: str, options: dict[str, Any] | None, wait_s: float | None) -> Path:
    from elasticyolo.s3options import s3_options

    if uri in _held:
        return _held[uri][1]
    ref = SourceRef.parse(uri)
    cache = cache_from_env()
    entry = cache.entry(uri)
    under_agent = os.environ.get(STAGER_ENV) == "agent"
    wait_s = float(os.environ.get("ELASTICYOLO_DATA_WAIT_S", "3600")) if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    lock = DatasetLock(entry)
    logged = False
    while True:
        left = max(0.0, deadline - time.monotonic())
        if not lock.acquire(exclusive=False, timeout=left):
            lock.close()
            raise StagingError(f"{ref.kind} {uri}: not staged on this node after {wait_s:g}s")
        meta = entry.read_meta()
        local = ref.local(entry)
        if meta.get("state") == "ready" and meta.get("uri") == uri and local.is_file():
            _held[uri] = (lock, local)
            return local
        lock.release()
        if not under_agent:
            Stager(cache, options if options is not None else s3_options(uri)).stage(uri)
            continue
        if not logged:
            _log().info(f"waiting for the agent to stage the {ref.kind}", source=uri, state=meta.get("state"))
            logged = True
        if time.monotonic() >= deadline:
            lock.close()
            raise StagingError(f"{ref.kind} {uri}: not staged on this node after {wait_s:g}s "
                               f"(last state: {meta.get('state')}: {meta.get('error') or '-'})")
        time.sleep(0.5)


def release(uri: str) -> None:
    """Drop this process's shared lock on `uri`'s copy (resolve_data_yaml keeps it otherwise)."""
    held = _held.pop(uri, None)
    if held is not None:
        held[0].close()


def spec_inputs(spec: Any) -> list[tuple[str, str]]:
    """(option, uri) of the spec's `s3://` inputs a node stages, in order: the dataset, then the
    weights (`model=`, `pretrained=`)."""
    out: list[tuple[str, str]] = []
    for option in ("data", "model", "pretrained"):
        uri = getattr(spec, option, None)
        if uri and is_remote(str(uri)) and str(uri) not in [u for _, u in out]:
            out.append((option, str(uri)))
    return out


def spec_sources(spec: Any) -> list[str]:
    """The spec's `s3://` inputs a node stages (`spec_inputs`), as URIs."""
    return [uri for _, uri in spec_inputs(spec)]


def resolve_for_spec(spec: Any) -> Path | None:
    """Stage (or wait for) a spec's `s3://` inputs with the spec's own S3 options: the dataset and
    the weights. Returns the local data.yaml, None for a local one. Later `load_data_yaml(spec.data)`
    and `local_weights` calls reuse the result."""
    from elasticyolo.s3options import s3_options

    for option, uri in spec_inputs(spec):
        resolve_staged(uri, s3_options(uri, spec), option=None if option == "data" else option)
    return resolve_staged(spec.data) if is_remote(spec.data) else None
