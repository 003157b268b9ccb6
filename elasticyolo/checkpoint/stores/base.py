"""The store interface: a flat key space under one root (an S3 prefix or a directory).

Keys are relative, '/'-separated (e.g. `job/manifests/000000000200-....json`). Both stores give the
same semantics so the manager, restore and the CLI never care which one they talk to.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Iterator, Protocol, runtime_checkable


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    last_modified: float  # unix seconds
    metadata: dict[str, str] = field(default_factory=dict)


class PreconditionFailed(Exception):
    """A conditional put (if_none_match) found the key already there."""


class NotFound(Exception):
    """The key does not exist."""


@runtime_checkable
class Store(Protocol):
    uri: str

    def check(self, *, write: bool = False) -> None:
        """Raise UserError/UnavailableError with one line if the store cannot be used."""

    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False,
                  content_type: str = "application/octet-stream") -> None: ...

    def put_file(self, key: str, fileobj: IO[bytes], size: int, *, metadata: dict[str, str] | None = None,
                 sha256: str | None = None) -> None:
        """Upload a (possibly large) seekable file object from its start. `sha256` (hex), when the
        caller has it, lets a store have the server check the bytes it received."""

    def get_bytes(self, key: str) -> bytes: ...

    def download(self, key: str, fileobj: IO[bytes]) -> None: ...

    def head(self, key: str) -> ObjectInfo | None: ...

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with prefix, in lexicographic key order."""

    def delete(self, keys: list[str]) -> None: ...
