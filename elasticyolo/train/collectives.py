"""The collective operations engine-neutral worker code needs (restore, commit interval, sharded
validation), implemented by each engine over its own communication layer (Horovod, torch.distributed).
"""

from __future__ import annotations

from typing import Any, Protocol


class Collectives(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """`src`'s `obj` on every rank (small objects)."""

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """`src`'s `data` on every rank (large payloads: a whole training state)."""


class Solo:
    """A world of one (single process, or before a collective layer exists)."""

    rank = 0
    size = 1

    def allgather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        assert data is not None
        return data
