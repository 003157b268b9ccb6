"""`file:///path`: a directory tree with the same semantics as the S3 store.

Writes go to a temp file in the same directory and are renamed into place (readers never see half a
file); `if_none_match` uses os.link, which fails atomically when the target already exists.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import IO, Iterable, Iterator

from elasticyolo.checkpoint.stores.base import NotFound, ObjectInfo, PreconditionFailed
from elasticyolo.errors import UserError

_CHUNK = 8 * 1024 * 1024


class FileStore:
    supports_metadata = False  # no object metadata: the manager verifies by size (atomic rename)

    def __init__(self, uri: str, root: str) -> None:
        self.uri = uri
        self.root = Path(root)

    def _path(self, key: str) -> Path:
        if not key or key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"bad key {key!r}")
        return self.root / key

    def check(self, *, write: bool = False) -> None:
        where = f"checkpoint store {self.uri}"
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"{where}: {self.root} is not a directory")
        if not self.root.exists():
            parent = next((p for p in self.root.parents if p.exists()), None)
            if parent is None or not os.access(parent, os.W_OK):
                raise UserError(f"{where}: {self.root} does not exist and cannot be created")
            if write:
                try:
                    self.root.mkdir(parents=True, exist_ok=True)
                except OSError as exc:
                    raise UserError(f"{where}: cannot create {self.root} ({exc.strerror})") from None
            return
        if not os.access(self.root, os.R_OK | os.X_OK):
            raise UserError(f"{where}: {self.root} is not readable")
        if write and not os.access(self.root, os.W_OK):
            raise UserError(f"{where}: {self.root} is not writable")

    def _write(self, key: str, src: IO[bytes] | bytes | Iterable[memoryview], exclusive: bool) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                if isinstance(src, (bytes, bytearray, memoryview)):
                    out.write(src)
                elif hasattr(src, "read"):
                    shutil.copyfileobj(src, out, _CHUNK)  # type: ignore[arg-type]
                else:
                    for piece in src:
                        out.write(piece)
                out.flush()
                os.fsync(out.fileno())
            if exclusive:
                try:
                    os.link(tmp, path)
                except FileExistsError:
                    raise PreconditionFailed(key) from None
            else:
                os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False,
                  content_type: str = "application/octet-stream") -> None:
        self._write(key, data, exclusive=if_none_match)

    def put_file(self, key: str, fileobj: IO[bytes], size: int, *, metadata: dict[str, str] | None = None,
                 sha256: str | None = None) -> None:
        # No metadata: the manager re-hashes local files instead. A spool is written from its
        # pieces (views: no read copies).
        fileobj.seek(0)
        views = getattr(fileobj, "views", None)
        self._write(key, views() if views is not None else fileobj, exclusive=False)

    def get_bytes(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(key) from None

    def download(self, key: str, fileobj: IO[bytes]) -> None:
        try:
            with open(self._path(key), "rb") as src:
                fileobj.seek(0)
                fileobj.truncate()
                shutil.copyfileobj(src, fileobj, _CHUNK)
        except FileNotFoundError:
            raise NotFound(key) from None

    def head(self, key: str) -> ObjectInfo | None:
        try:
            st = self._path(key).stat()
        except FileNotFoundError:
            return None
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        if not self.root.is_dir():
            return iter(())
        found: list[ObjectInfo] = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith("."):  # temp files of writes in progress
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    try:
                        st = full.stat()
                    except FileNotFoundError:
                        continue
                    found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        return iter(sorted(found, key=lambda o: o.key))

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self._path(key).unlink()
            except OSError as exc:
                if exc.errno != errno.ENOENT:
                    raise

    def __repr__(self) -> str:
        return f"FileStore({self.uri!r})"
