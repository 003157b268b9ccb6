"""The `elasticyolo worker` flags an engine's worker entry may honour (`Engine.worker_main`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerOptions:
    """`elasticyolo worker` flags an engine may honour."""

    progress_jsonl: str | None = None  # rank 0 appends one JSON record per step here
    prewarm_slot: int | None = None  # agent use: build the core for this local slot, then wait (Horovod)
