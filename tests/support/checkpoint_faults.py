"""Faults for the checkpoint manager's tests. They run inside the uploader process, so they
live in the package (importable there by name) and take their cues from files, not from
objects shared with the test."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import IO, Any, Mapping

from elasticyolo.checkpoint.stores.file import FileStore


class GatedSerializer:
    """torch.save, once the gate file exists (so a test can hold an upload in flight)."""

    def __init__(self, gate: str | Path, timeout: float = 30.0) -> None:
        self.gate, self.timeout = str(gate), timeout

    def __call__(self, ckpt: Mapping[str, Any], out: IO[bytes]) -> None:
        import torch

        deadline = time.monotonic() + self.timeout
        while not Path(self.gate).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        torch.save(dict(ckpt), out)


def _count_down(counter: str) -> bool:
    """True, and one less, while the counter file holds a positive number."""
    p = Path(counter)
    n = int(p.read_text()) if p.exists() else 0
    if n > 0:
        p.write_text(str(n - 1))
    return n > 0


class TruncatingStore(FileStore):
    """Writes half the object while the counter file says uploads are bad (a half-written
    checkpoint), counting it down by one each time."""

    crash = False  # and then kill the (uploader) process it runs in

    def __init__(self, root: Path, counter: Path) -> None:
        super().__init__(f"file://{root}", str(root))
        self.counter = str(counter)

    def set_bad(self, n: int) -> None:
        Path(self.counter).write_text(str(n))

    def put_file(self, key: str, fileobj: Any, size: int, *, metadata: dict[str, str] | None = None,
                 sha256: str | None = None) -> None:
        if _count_down(self.counter):
            fileobj.seek(0)
            self.put_bytes(key, bytes(fileobj.read(size // 2)))
            if self.crash:
                os.kill(os.getpid(), signal.SIGKILL)
            return
        super().put_file(key, fileobj, size, metadata=metadata, sha256=sha256)


class CrashingStore(TruncatingStore):
    """Writes half the object, then kills its own (uploader) process, while the counter file
    says so, counting it down by one each time."""

    crash = True


class RecordingSerializer(GatedSerializer):
    """The production serializer, behind a gate, writing the id of the process it runs in."""

    def __init__(self, gate: str | Path, record: str | Path, timeout: float = 60.0) -> None:
        super().__init__(gate, timeout)
        self.record = str(record)

    def __call__(self, ckpt: Mapping[str, Any], out: IO[bytes]) -> None:
        import os

        from elasticyolo.checkpoint.format import serialize

        Path(self.record).write_text(str(os.getpid()))
        deadline = time.monotonic() + self.timeout
        while not Path(self.gate).exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        serialize(ckpt, out)


class CrashingSerializer:
    """Kills its own (uploader) process mid-serialization while the counter file says so,
    counting it down by one each time; otherwise torch.save."""

    def __init__(self, counter: str | Path) -> None:
        self.counter = str(counter)

    def __call__(self, ckpt: Mapping[str, Any], out: IO[bytes]) -> None:
        import torch

        if _count_down(self.counter):
            out.write(b"PK\x03\x04")  # part of a file, then gone
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save(dict(ckpt), out)
