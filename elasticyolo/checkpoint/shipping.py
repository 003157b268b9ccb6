"""Moving a checkpoint snapshot from the training process to the uploader process without
serializing its tensors in the training process.

Training side: the snapshot's tensors are copied straight into a `HostSlot`, a reusable
shared-memory buffer (`capture()` makes `format._Copier` allocate there, so this *is* the one
copy to host memory). `dumps()` then pickles only the structure, each tensor as a small
reference (offset, shape, stride, dtype) into the slot; a tensor found outside the slot is
copied in first. Uploader side: `loads()` rebuilds the dict, each tensor a view of its own bytes
in the slot with a storage of its own (no copy; `torch.save` writes one storage per tensor as
usual, not the whole slot); tensors that shared memory in the snapshot (the EMA module's and its
state_dict's) share one storage, so the file stores them once. The uploader holds the slot until
it has serialized the checkpoint (the manager's other slot takes the next snapshot meanwhile).

Also here: `dumps_portable()` pickles a store for the uploader process (locks are recreated,
live network clients dropped: stores create them lazily).
"""

from __future__ import annotations

import contextlib
import io
import pickle
import threading
from typing import Any, Iterator

import torch
from torch import nn

ALIGN = 64
SLACK = 1 << 20


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostSlot:
    """A shared-memory buffer that one snapshot at a time is copied into. What does not fit goes
    to extra chunks, and the next snapshot gets one buffer big enough for everything."""

    CHUNK = 16 << 20

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.used = 0
        self.extra: list[torch.Tensor] = []  # overflow chunks of this snapshot
        self._extra_used = 0  # bytes used in the last chunk
        self._extra_total = 0
        self._want = 0

    @property
    def capacity(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def begin(self) -> None:
        if self._want > self.capacity:
            self.buf = None
            self.buf = torch.empty(self._want, dtype=torch.uint8).share_memory_()
        self.used, self.extra, self._extra_used, self._extra_total = 0, [], 0, 0

    def end(self) -> None:
        """After a snapshot: next time, make room for everything in one buffer."""
        total = self.used + self._extra_total
        if total > self.capacity:
            self._want = _align(total + total // 8 + SLACK)

    def alloc(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= int(d)
        nbytes = numel * dtype.itemsize
        off = _align(self.used)
        if self.buf is not None and off + nbytes <= self.capacity:
            self.used = off + nbytes
            return self.buf[off:off + nbytes].view(dtype).view(shape)
        off = _align(self._extra_used)
        if not self.extra or off + nbytes > self.extra[-1].numel():
            self.extra.append(torch.empty(max(nbytes, self.CHUNK), dtype=torch.uint8).share_memory_())
            off = 0
        self._extra_used = off + nbytes
        self._extra_total += _align(nbytes)
        return self.extra[-1][off:off + nbytes].view(dtype).view(shape)

    def locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(buffer number, byte offset) of `t`'s data inside this slot, or None."""
        ptr = t.untyped_storage().data_ptr()
        off = t.storage_offset() * t.element_size()
        if self.buf is not None and ptr == self.buf.untyped_storage().data_ptr():
            return 0, off
        for k, e in enumerate(self.extra):
            if ptr == e.untyped_storage().data_ptr():
                return k + 1, off
        return None

    def buffers(self) -> list[torch.Tensor]:
        return ([self.buf] if self.buf is not None else [torch.empty(0, dtype=torch.uint8)]) + list(self.extra)


@contextlib.contextmanager
def capture(slot: HostSlot) -> Iterator[None]:
    """Within: checkpoint building (`format.build_checkpoint`) copies tensors into `slot`."""
    from elasticyolo.checkpoint import format as fmt

    slot.begin()
    token = fmt.HOST_ALLOCATOR.set(slot.alloc)
    try:
        yield
    finally:
        fmt.HOST_ALLOCATOR.reset(token)


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, slot: HostSlot) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.slot = slot

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        t = obj.detach()
        where = self.slot.locate(t)
        if where is None:
            copy = self.slot.alloc(t.shape, t.dtype)
            copy.copy_(t)
            t, where = copy, self.slot.locate(copy)
            assert where is not None
        return ("t", where[0], where[1], tuple(t.shape), tuple(t.stride()), str(t.dtype).removeprefix("torch."),
                bool(obj.requires_grad), isinstance(obj, nn.Parameter))


def dumps(obj: Any, slot: HostSlot) -> bytes:
    """The structure of `obj`, its tensors as references into `slot` (training side)."""
    buf = io.BytesIO()
    _Pickler(buf, slot).dump(obj)
    slot.end()
    return buf.getvalue()


def byte_views(buffers: list[torch.Tensor]) -> list[memoryview]:
    """The slot's buffers as flat byte views (uploader side)."""
    return [memoryview(b.numpy()).cast("B") for b in buffers]


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, buffers: list[torch.Tensor]) -> None:
        super().__init__(file)
        self.bytes = byte_views(buffers)
        self.views: dict[tuple[Any, ...], torch.Tensor] = {}

    def persistent_load(self, pid: Any) -> Any:
        _, k, off, shape, stride, dtype_name, requires_grad, is_param = pid
        where = (k, off, shape, stride, dtype_name)
        t = self.views.get(where)
        if t is None:  # one storage per place in the slot: tensors that shared memory still do
            t = self.views[where] = _view(self.bytes[k], off, shape, stride, getattr(torch, dtype_name))
        if is_param:
            return nn.Parameter(t, requires_grad=requires_grad)
        return t.requires_grad_(requires_grad) if requires_grad else t


def _view(mem: memoryview, off: int, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor at byte `off` of `mem`, over a storage holding just its bytes (not a copy)."""
    itemsize = dtype.itemsize
    span = 0 if 0 in shape else 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    if span == 0:  # frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(mem[off:off + span * itemsize], dtype=torch.uint8).view(dtype)
    return flat.as_strided(shape, stride)


def loads(data: bytes, buffers: list[torch.Tensor]) -> Any:
    """Rebuild what `dumps` pickled, over the slot's buffers (uploader side). The tensors are views
    of the slot: serialize before letting the slot go."""
    return _Unpickler(io.BytesIO(data), buffers).load()


# ---- stores for another process -----------------------------------------------------------------
_LOCK_TYPES = {type(threading.Lock()): threading.Lock, type(threading.RLock()): threading.RLock}


def _none() -> None:
    return None


class _PortablePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        make = _LOCK_TYPES.get(type(obj))
        if make is not None:
            return make, ()
        if type(obj).__module__.startswith(("botocore.", "boto3.")) and type(obj).__name__ not in ("Config",):
            return _none, ()  # clients and sessions: the store makes a new one on first use
        return NotImplemented


def dumps_portable(obj: Any) -> bytes:
    buf = io.BytesIO()
    _PortablePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
