"""sha256 of checkpoint objects: while writing (one pass over the bytes) and of a file read back."""

from __future__ import annotations

import hashlib
from typing import IO

CHUNK = 8 * 1024 * 1024


def sha256_of(fileobj: IO[bytes]) -> tuple[str, int]:
    fileobj.seek(0)
    h, n = hashlib.sha256(), 0
    while chunk := fileobj.read(CHUNK):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


class HashingWriter:
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
