"""Checkpoints: stores (`s3://`, `file://`), background uploads with manifests and retention,
Ultralytics-compatible files, and restore. Importing this package does not import torch; only
`elasticyolo.checkpoint.format` (and `restore_latest` when called) do.

    store = open_store(spec.checkpoint); store.check(write=True)
    mgr = CheckpointManager(store, job, save_period_steps=..., save_period_s=..., keep_last=..., keep_epochs=...)
    mgr.maybe_save(step, epoch, lambda: build_checkpoint(...), epoch_end=...)
    restored = restore_latest(store, job)   # -> (ckpt, manifest) | None
"""

from __future__ import annotations

from elasticyolo.checkpoint.catalog import find, list_manifests, prune, read_latest
from elasticyolo.checkpoint.layout import Manifest
from elasticyolo.checkpoint.manager import CheckpointManager
from elasticyolo.checkpoint.restore import CorruptCheckpoint, download_verified, restore_latest
from elasticyolo.checkpoint.stores import Store, open_store, parse_uri

__all__ = [
    "CheckpointManager", "CorruptCheckpoint", "Manifest", "Store", "download_verified", "find", "list_manifests",
    "open_store", "parse_uri", "prune", "read_latest", "restore_latest", "manager_for_spec",
]


def manager_for_spec(spec: object, job: str, **options: object) -> CheckpointManager | None:
    """A manager configured from a TrainSpec's checkpoint fields (None when spec.checkpoint is unset)."""
    uri = getattr(spec, "checkpoint", None)
    if not uri:
        return None
    from elasticyolo.s3options import s3_options

    store = open_store(str(uri), **s3_options(str(uri), spec))  # SSE etc. from the spec, else the agent
    return CheckpointManager(
        store, job,
        save_period_steps=int(getattr(spec, "save_period_steps", 200)),
        save_period_s=float(getattr(spec, "save_period_s", 300.0)),
        keep_last=int(getattr(spec, "keep_last", 3)),
        keep_epochs=bool(getattr(spec, "keep_epochs", False)),
        **options,  # type: ignore[arg-type]
    )
