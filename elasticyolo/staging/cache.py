"""The node-local cache that S3 datasets and weights files are staged into (see stager.py).

Layout under the cache root (`$ELASTICYOLO_DATA_CACHE`, else `$CACHE_DIRECTORY/datasets` under
systemd, else `$XDG_CACHE_HOME/elasticyolo/datasets`):

    <root>/<slug>-<hash>/files/...        a mirror of s3://bucket/prefix/ (verified objects only);
                                          for weights, the one file
    <root>/<slug>-<hash>/data.yaml        the dataset's data.yaml with `path:` set to files/
    <root>/<slug>-<hash>/journal.jsonl    one line per verified object: key, size, etag (resume)
    <root>/<slug>-<hash>/partial/         large objects being fetched in segments (resume)
    <root>/<slug>-<hash>/tmp/             downloads not yet verified (wiped on every run)
    <root>/<slug>-<hash>/meta.json        uri, state (staging/ready/failed), sizes, listing digest, last use
    <root>/.locks/<slug>-<hash>.lock      flock: exclusive while staging or evicting, shared while in use

The size cap evicts least recently used datasets whose lock is free (no job uses them).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from elasticyolo.errors import UserError

GiB = 1024 ** 3
_SLUG = re.compile(r"[^A-Za-z0-9._-]+")


def default_cache_root(environ: dict[str, str] | None = None) -> Path:
    env = os.environ if environ is None else environ
    if env.get("ELASTICYOLO_DATA_CACHE"):
        return Path(env["ELASTICYOLO_DATA_CACHE"])
    if env.get("CACHE_DIRECTORY"):  # systemd CacheDirectory= (first entry)
        return Path(env["CACHE_DIRECTORY"].split(":")[0]) / "datasets"
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "elasticyolo" / "datasets"


class CacheFullError(UserError):
    """The dataset does not fit under the cache cap (or on the disk), even after eviction."""


@dataclass(frozen=True)
class CacheEntry:
    """One dataset's directory in the cache."""

    root: Path
    name: str

    @property
    def dir(self) -> Path:
        return self.root / self.name

    @property
    def files(self) -> Path:
        return self.dir / "files"

    @property
    def data_yaml(self) -> Path:
        return self.dir / "data.yaml"

    @property
    def journal_path(self) -> Path:
        return self.dir / "journal.jsonl"

    @property
    def meta_path(self) -> Path:
        return self.dir / "meta.json"

    @property
    def partial(self) -> Path:
        return self.dir / "partial"

    @property
    def tmp(self) -> Path:
        return self.dir / "tmp"

    @property
    def lock_path(self) -> Path:
        return self.root / ".locks" / f"{self.name}.lock"

    def local_path(self, key: str) -> Path:
        """Where object `key` (relative to the dataset prefix) lives; ValueError when the key
        would escape the dataset directory (`..`, absolute)."""
        parts = key.split("/")
        if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"unsafe object key {key!r}")
        return self.files.joinpath(*parts)

    # ---- meta and journal ---------------------------------------------------------------
    def read_meta(self) -> dict[str, Any]:
        try:
            data = json.loads(self.meta_path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def write_meta(self, **updates: Any) -> dict[str, Any]:
        meta = {**self.read_meta(), **updates}
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.meta_path.with_name(f".meta.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta, sort_keys=True))
        os.replace(tmp, self.meta_path)
        return meta

    def journal(self) -> dict[str, tuple[int, str]]:
        """key -> (size, etag) of every object verified so far (later lines win)."""
        out: dict[str, tuple[int, str]] = {}
        try:
            with open(self.journal_path) as fh:
                for line in fh:
                    try:
                        rec = json.loads(line)
                        out[str(rec["k"])] = (int(rec["s"]), str(rec["e"]))
                    except (ValueError, KeyError, TypeError):
                        continue  # a line torn by a crash
        except FileNotFoundError:
            pass
        return out

    def touch(self) -> None:
        self.write_meta(last_used=time.time())


class Journal:
    """Appends verified objects; flushed every line, fsynced at most every `sync_s` (a line lost
    in a crash only costs re-hashing that file on the next run)."""

    def __init__(self, entry: CacheEntry, sync_s: float = 0.5) -> None:
        entry.dir.mkdir(parents=True, exist_ok=True)
        self._fh = open(entry.journal_path, "a", buffering=1)
        self._sync_s = sync_s
        self._last_sync = time.monotonic()

    def add(self, key: str, size: int, etag: str) -> None:
        self._fh.write(json.dumps({"k": key, "s": size, "e": etag}, separators=(",", ":")) + "\n")
        now = time.monotonic()
        if now - self._last_sync >= self._sync_s:
            os.fsync(self._fh.fileno())
            self._last_sync = now

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()


class DatasetLock:
    """flock on the entry's lock file: exclusive (staging, eviction) or shared (in use)."""

    def __init__(self, entry: CacheEntry) -> None:
        entry.lock_path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(entry.lock_path, os.O_RDWR | os.O_CREAT, 0o600)

    def acquire(self, exclusive: bool, timeout: float | None = None,
                cancelled: Callable[[], bool] = lambda: False) -> bool:
        """Wait for the lock (polling, so a cancel or timeout can end the wait). True if held."""
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(self.fd, op)
                return True
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
            if cancelled() or (deadline is not None and time.monotonic() >= deadline):
                return False
            time.sleep(0.1)

    def release(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        os.close(self.fd)


class DatasetCache:
    def __init__(self, root: Path | str | None = None, max_bytes: int | None = None) -> None:
        self.root = Path(root) if root else default_cache_root()
        self.max_bytes = max_bytes

    @classmethod
    def from_settings(cls, root: str | None, max_gb: float | None) -> "DatasetCache":
        return cls(root or None, int(max_gb * GiB) if max_gb else None)

    def entry(self, uri: str, endpoint: str | None = None) -> CacheEntry:
        """The entry of a dataset: one per (S3 endpoint, bucket/prefix) of its data.yaml; of a
        weights file (any other object): one per (S3 endpoint, bucket/key)."""
        base = uri.removeprefix("s3://")
        if base.endswith((".yaml", ".yml")):
            base = base.rsplit("/", 1)[0]
        digest = hashlib.sha256(f"{endpoint or ''}|{base}".encode()).hexdigest()[:12]
        slug = _SLUG.sub("-", base).strip("-.")[-60:] or "dataset"
        return CacheEntry(self.root, f"{slug}-{digest}")

    def entries(self) -> Iterator[CacheEntry]:
        if not self.root.is_dir():
            return
        for d in sorted(self.root.iterdir()):
            if d.is_dir() and not d.name.startswith("."):
                yield CacheEntry(self.root, d.name)

    @staticmethod
    def stored_bytes(entry: CacheEntry) -> int:
        """Bytes of the files an entry holds (what the cap counts, like the dataset's S3 size)."""
        total = 0
        for dirpath, _dirs, files in os.walk(entry.dir):
            for name in files:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except OSError:
                    continue
        return total

    def make_room(self, keep: CacheEntry, final_bytes: int, present_bytes: int, log: Any = None) -> list[str]:
        """Evict least recently used datasets (not `keep`, not in use) until `keep` can grow to
        `final_bytes` under the cap and on the disk. Returns the evicted entry names; raises
        CacheFullError when that is impossible."""
        evicted: list[str] = []
        others = [e for e in self.entries() if e.name != keep.name]
        sizes = {e.name: self.stored_bytes(e) for e in others}
        others.sort(key=lambda e: float(e.read_meta().get("last_used") or 0.0))
        needed = max(0, final_bytes - present_bytes)

        def fits() -> bool:
            if self.max_bytes is not None and sum(sizes.values()) + final_bytes > self.max_bytes:
                return False
            self.root.mkdir(parents=True, exist_ok=True)
            return shutil.disk_usage(self.root).free > needed + 64 * 1024 * 1024  # keep a margin

        for victim in others:
            if fits():
                break
            lock = DatasetLock(victim)
            try:
                if not lock.acquire(exclusive=True, timeout=0):
                    continue  # a job uses it (shared lock) or it is being staged
                trash = self.root / f".trash-{victim.name}-{os.getpid()}"
                os.replace(victim.dir, trash)
                shutil.rmtree(trash, ignore_errors=True)
                evicted.append(victim.name)
                sizes.pop(victim.name, None)
                if log is not None:
                    log.info("dataset evicted", dataset=victim.name, reason="cache cap")
            finally:
                lock.release()
                lock.close()
        if not fits():
            gb = lambda b: f"{b / GiB:.2f} GB"  # noqa: E731
            in_use = sum(sizes.values())
            if self.max_bytes is not None and in_use + final_bytes > self.max_bytes:
                raise CacheFullError(
                    f"dataset cache {self.root}: the dataset needs {gb(final_bytes)} but the cap is "
                    f"{gb(self.max_bytes)} and {gb(in_use)} is held by datasets in use (data_cache_max_gb)")
            raise CacheFullError(f"dataset cache {self.root}: {gb(needed)} more needed but only "
                                 f"{gb(shutil.disk_usage(self.root).free)} free on the disk")
        return evicted
