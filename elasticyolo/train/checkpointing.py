"""Checkpoints from the training loop: restore on a cold start, save after commits, final save.

Glue between `TrainCore` (`elasticyolo.train.state`) and the checkpoint subsystem
(`elasticyolo.checkpoint`). Only rank 0 saves and restores: a freshly started world compares the
store's newest step with the node-local snapshots (`train/snapshots.py` `restore_newest`), and
rank 0 hands what it loaded to the others (or Horovod's sync does). Only committed state is ever
checkpointed: saves happen at a commit, right after the node-local snapshot (`worker_runtime/commit.py`).
"""

from __future__ import annotations

from typing import Any, Callable

from elasticyolo.checkpoint import CheckpointManager, open_store, read_latest, restore_latest
from elasticyolo.log import get_logger
from elasticyolo.s3options import s3_options
from elasticyolo.spec import TrainSpec
from elasticyolo.train.core import TrainCore
from elasticyolo.train.state import build_core_checkpoint, load_core_checkpoint

log = get_logger("elasticyolo.checkpointing")


def saves_checkpoints(rank: int) -> bool:
    """Only rank 0 saves (and so needs a writable store and an uploader)."""
    return rank == 0


def open_checked_store(spec: TrainSpec, write: bool) -> Any:
    """The spec's checkpoint store (None without one), checked: one clear line for a bad URI,
    bucket or credentials (`write`: also a missing write permission)."""
    if not spec.checkpoint:
        return None
    # The job's S3 options (SSE, endpoint, region, profile), else the agent's (env).
    store = open_store(spec.checkpoint, **s3_options(spec.checkpoint, spec))
    store.check(write=write)
    return store


class Checkpointer:
    """`store`: opened and checked beforehand (`open_checked_store`, e.g. by a pre-warmed worker
    before it has a rank), else opened here, with a write check on rank 0."""

    def __init__(self, spec: TrainSpec, job: str, rank: int,
                 sinks: list[Callable[[dict[str, Any]], None]] | None = None, store: Any = None) -> None:
        self.job, self.rank = job, rank
        self.sinks = sinks or []  # progress sinks: told {"kind": "checkpoint", ...} when one lands
        self._published_step = -1
        self.manager: CheckpointManager | None = None
        self.store: Any = store if store is not None else open_checked_store(spec, write=saves_checkpoints(rank))
        if self.store is not None:
            self.manager = CheckpointManager(
                self.store, job, save_period_steps=spec.save_period_steps, save_period_s=spec.save_period_s,
                keep_last=spec.keep_last, keep_epochs=spec.keep_epochs, background_nice=spec.checkpoint_nice,
            )

    @property
    def enabled(self) -> bool:
        return self.manager is not None

    def restore_into(self, core: TrainCore, newer_than: int = -1) -> bool:
        """Load the newest verified checkpoint of the job into `core` (rank 0 of a cold start),
        unless it is not newer than step `newer_than` (e.g. a node-local snapshot already loaded)."""
        if self.manager is None:
            return False
        found = restore_latest(self.store, self.job)
        if found is None:
            log.info("checkpoint_none", job=self.job, store=self.store.uri)
            return False
        ckpt, manifest = found
        if manifest.step <= newer_than:
            log.info("checkpoint_older_than_snapshot", job=self.job, step=manifest.step, snapshot_step=newer_than)
            self.manager.note_restored(manifest)
            return False
        load_core_checkpoint(core, ckpt)
        self.manager.note_restored(manifest)
        log.info("checkpoint_restored", job=self.job, step=manifest.step, epoch=manifest.epoch, key=manifest.key)
        return True

    def latest_step(self) -> int:
        """The step of the job's newest checkpoint in the store (-1: none). Its manifest counts as
        the last save from here on, as after a restore."""
        if self.manager is None:
            return -1
        manifest = read_latest(self.store, self.job)
        if manifest is None:
            return -1
        self.manager.note_restored(manifest)
        return manifest.step

    def after_commit(self, core: TrainCore) -> None:
        if self.manager is None or not saves_checkpoints(core.rank):
            return
        epoch_end = core.progress.consumed == 0 and core.progress.step > 0
        self.manager.maybe_save(core.progress.step, core.progress.epoch, lambda: build_core_checkpoint(core),
                                epoch_end=epoch_end)
        self._publish_landed()

    def _publish_landed(self) -> None:
        """Uploads land in the background; the next commit after one lands reports it."""
        last = self.manager.last if self.manager is not None else None
        if last is None or last.step == self._published_step:
            return
        self._published_step = last.step
        rec = {"kind": "checkpoint", "uri": f"{self.store.uri.rstrip('/')}/{last.key}", "epoch": last.epoch,
               "step": last.step, "at": last.created, "size": last.size, "upload_s": round(last.upload_s, 3),
               "snapshot_s": round(last.snapshot_s, 4)}
        for sink in self.sinks:
            sink(rec)

    def save_now(self, core: TrainCore, reason: str, timeout: float | None = 120.0) -> bool:
        """A blocking save (drain, job end). True when it landed in time."""
        if self.manager is None or not saves_checkpoints(core.rank):
            return True
        landed = self.manager.save(core.progress.step, core.progress.epoch, lambda: build_core_checkpoint(core),
                                   reason=reason, wait=True, timeout=timeout)
        self._publish_landed()
        return landed

    def status(self) -> dict[str, Any] | None:
        return self.manager.status() if self.manager is not None else None

    def close(self, timeout: float = 60.0) -> None:
        if self.manager is not None:
            self.manager.close(timeout=timeout)
