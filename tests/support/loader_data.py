"""A tiny dataset for the data loader's tests: each sample is its index, built in a chosen time,
and every build is recorded (process id, index) in a log file, so a test can see which requests
workers really built and which they skipped. Lives in the package (not under tests/) because
the loader's processes unpickle it by module name."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch


class IndexDataset:
    def __init__(self, n: int, seconds: float = 0.0, log: str | Path | None = None) -> None:
        self.n, self.seconds = n, seconds
        self.log = str(log) if log else None
        self.transforms = "open"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self.n:
            raise IndexError(f"sample {i} out of range")
        if self.seconds:
            time.sleep(self.seconds)
        if self.log:
            with open(self.log, "a") as fh:
                fh.write(f"{os.getpid()} {i}\n")
        return {"img": torch.full((3, 4, 4), i, dtype=torch.uint8), "index": i, "transforms": self.transforms}

    def close_mosaic(self, hyp: Any) -> None:
        self.transforms = "closed"

    @staticmethod
    def collate_fn(items: list[dict[str, Any]]) -> dict[str, Any]:
        return {"img": torch.stack([it["img"] for it in items]), "index": [it["index"] for it in items],
                "transforms": [it["transforms"] for it in items], "pid": os.getpid()}


def built(log: str | Path) -> list[tuple[int, int]]:
    """(pid, index) of every sample built so far."""
    p = Path(log)
    if not p.exists():
        return []
    return [(int(a), int(b)) for a, b in (line.split() for line in p.read_text().splitlines() if line.strip())]
