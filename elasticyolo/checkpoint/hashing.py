"""sha256 of checkpoint objects: while writing (one pass over the bytes) and of a file read back."""

from __future__ import annotations

import hashlib
import io
from typing import IO, Any

CHUNK = 8 * 1024 * 1024


def sha256_of(fileobj: IO[bytes]) -> tuple[str, int]:
    fileobj.seek(0)
    h, n = hashlib.sha256(), 0
    while chunk := fileobj.read(CHUNK):
        h.update(chunk)
        n += len(chunk)
    return h.hexdigest(), n


class HashingWriter(io.RawIOBase):
    """The write side of a file that hashes and counts what passes through. Raw: wrapped in
    `buffered()`, the many small writes of a serializer (torch.save writes five per tensor
    around its bytes) reach it in batches, large ones as they are."""

    def __init__(self, out: IO[bytes]) -> None:
        super().__init__()
        self.out, self.sha, self.size = out, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.sha.update(data)
        self.size += n
        self.out.write(data)
        return n

    def tell(self) -> int:
        return self.size

    def buffered(self, size: int = 16 * 1024) -> io.BufferedWriter:
        """Flush it before reading the hash; it never closes what it wraps (no close())."""
        return io.BufferedWriter(self, buffer_size=size)

    def close(self) -> None:
        pass  # the spool outlives the writer
