"""An in-memory file the uploader serializes every checkpoint into, reused from one to the next.

A fresh buffer per checkpoint paid for new pages each time (the kernel zeroes them, one fault per
page) and for regrowth copies: 11 % of the uploader's CPU time for yolov8n (py-spy). Writing into
memory the previous checkpoint already touched costs a copy and nothing else. The uploader
serializes one checkpoint at a time, so one spool serves them all; it keeps its memory (about
one checkpoint) between checkpoints.
"""

from __future__ import annotations

import io
from typing import Any


class MemorySpool:
    """A seekable, readable and writable file over a growable buffer; `reset()` empties it
    without giving the memory back."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._size = 0  # bytes written since reset (the buffer may be longer)
        self._pos = 0

    def reset(self) -> "MemorySpool":
        self._size = self._pos = 0
        return self

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        end = self._pos + len(mv)
        # Within the buffer this overwrites in place; past its end the bytearray grows (amortized).
        self._buf[self._pos:end] = mv
        self._pos, self._size = end, max(self._size, end)
        return len(mv)

    def read(self, n: int | None = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        if end <= self._pos:
            return b""
        out = bytes(memoryview(self._buf)[self._pos:end])
        self._pos = end
        return out

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        end = min(self._size, self._pos + len(out))
        n = max(0, end - self._pos)
        out[:n] = memoryview(self._buf)[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def truncate(self, size: int | None = None) -> int:
        self._size = self._pos if size is None else min(size, self._size)
        return self._size

    def getbuffer(self) -> memoryview:
        """The bytes written, without a copy (valid until the next write or reset)."""
        return memoryview(self._buf)[:self._size]

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.reset()

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:
        return False
