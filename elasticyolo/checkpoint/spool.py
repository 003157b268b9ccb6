"""The file every checkpoint is serialized into: it keeps references where it can, copies the rest.

`torch.save` hands each tensor's bytes to `write` as a view of the tensor's own memory, and the
uploader's tensors are views of the shared-memory slot the snapshot was taken into. Copying those
bytes once more into a buffer would be a pass over the whole checkpoint (36.6 MB for yolov8n, about
as long as the sha256 pass on a 2-core x86-64 VM), so a write that lies inside a registered buffer is
kept as a reference to it; headers and the pickle (a few KB) are copied into a reused arena.
Readers get views: the upload sends straight from the slot, which must therefore stay mapped and
unchanged until the spool is reset (the uploader holds the slot until its upload is over).

Without registered buffers it is a plain append-then-read in-memory file, reused from one
checkpoint to the next (a fresh buffer per checkpoint paid page faults and regrowth copies).
"""

from __future__ import annotations

import bisect
import io
from typing import Any, Iterator, Sequence


def _address(view: memoryview) -> int:
    import numpy as np  # here: the manager imports this module in processes that never write

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class SegmentSpool:
    """A file written once (appends only), then read: `reset()` empties it for the next
    checkpoint without giving the arena's memory back."""

    def __init__(self, min_reference: int = 16 * 1024) -> None:
        self.min_reference = min_reference  # smaller writes are copied (a lookup costs more)
        self._arena = bytearray()
        self._arena_used = 0
        self._segments: list[tuple[memoryview | None, int, int]] = []  # (referenced view or None: arena, start, length)
        self._starts: list[int] = []  # file offset of each segment
        self._bases: list[tuple[int, memoryview]] = []  # registered buffers by address
        self._base_addresses: list[int] = []
        self._size = 0
        self._pos = 0

    def reset(self, buffers: Sequence[memoryview] = ()) -> "SegmentSpool":
        """Empty, and keep references to writes that lie inside `buffers` (flat byte views)."""
        self._segments.clear()
        self._starts.clear()
        self._size = self._pos = self._arena_used = 0
        self._bases = sorted(((_address(b), b) for b in buffers if len(b)), key=lambda base: base[0])
        self._base_addresses = [a for a, _ in self._bases]
        return self

    # ---- writing ------------------------------------------------------------------------------
    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = len(mv)
        if self._pos != self._size:
            raise io.UnsupportedOperation("a spool is written sequentially")
        if n == 0:
            return 0
        ref = self._inside_a_buffer(mv) if n >= self.min_reference and self._bases else None
        if ref is not None:
            self._add(ref, 0, n)
        else:
            start, end = self._arena_used, self._arena_used + n
            try:
                self._arena[start:end] = mv  # in place within the arena, growing it past its end
            except BufferError:  # a reader still holds a view of it: grow into a new arena
                self._arena = bytearray(self._arena[:start])
                self._arena[start:end] = mv
            self._arena_used = end
            last = self._segments[-1] if self._segments else None
            if last is not None and last[0] is None and last[1] + last[2] == start:
                self._segments[-1] = (None, last[1], last[2] + n)
            else:
                self._add(None, start, n)
        self._size += n
        self._pos = self._size
        return n

    def _inside_a_buffer(self, mv: memoryview) -> memoryview | None:
        addr = _address(mv)
        i = bisect.bisect_right(self._base_addresses, addr) - 1
        if i < 0:
            return None
        base_addr, base = self._bases[i]
        off = addr - base_addr
        return base[off:off + len(mv)] if off + len(mv) <= len(base) else None

    def _add(self, source: memoryview | None, start: int, n: int) -> None:
        self._starts.append(self._size)
        self._segments.append((source, start, n))

    # ---- reading ------------------------------------------------------------------------------
    def _piece(self, k: int) -> memoryview:
        source, start, n = self._segments[k]
        return (memoryview(self._arena) if source is None else source)[start:start + n]

    def views(self) -> Iterator[memoryview]:
        """The content, in order, as views (no copies)."""
        for k in range(len(self._segments)):
            yield self._piece(k)

    def read(self, n: int | None = -1) -> bytes | memoryview:
        """Up to `n` bytes from the position: a view where they lie in one piece, else a copy."""
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        if end <= self._pos:
            return b""
        k = bisect.bisect_right(self._starts, self._pos) - 1
        piece = self._piece(k)
        off = self._pos - self._starts[k]
        if end - self._starts[k] <= len(piece):
            out: bytes | memoryview = piece[off:off + end - self._pos]
        else:
            joined = bytearray(piece[off:])
            while len(joined) < end - self._pos:
                k += 1
                joined += self._piece(k)[:end - self._pos - len(joined)]
            out = bytes(joined)
        self._pos = end
        return out

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        got = self.read(len(out))
        out[:len(got)] = got
        return len(got)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position {base + offset}")
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

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
