"""Node-local snapshots of the committed training state, for restarts of the whole world
(leader loss: the new driver starts new workers, which restore the newest snapshot).

The first worker of each node (local rank 0) writes `<work dir>/snapshots/latest.pt`
atomically at a commit, at most every `ELASTICYOLO_SNAPSHOT_S` seconds (default 10); every node
keeps one, so the state survives the loss of any node. Workers of a freshly started world
(`ELASTICYOLO_RESTORE=1`, set by the driver for its first world only: later joiners get the
state from Horovod's sync) agree on the newest snapshot with one allgather and take it from
its holder with one broadcast. The checkpoint subsystem (spec `checkpoint=`) supersedes this.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any

import horovod.torch as hvd
import torch

from elasticyolo.log import get_logger
from elasticyolo.train.core import Progress, TrainCore

log = get_logger("elasticyolo.snapshot")


def snapshot_dir() -> Path | None:
    base = os.environ.get("ELASTICYOLO_WORK_DIR")
    return Path(base) / "snapshots" if base else None


class LocalSnapshots:
    def __init__(self, directory: Path | None, local_rank: int, period_s: float | None = None) -> None:
        self.directory = directory
        self.enabled = directory is not None and local_rank == 0
        self.period_s = float(os.environ.get("ELASTICYOLO_SNAPSHOT_S", "10")) if period_s is None else period_s
        self._last = time.monotonic()

    @property
    def path(self) -> Path | None:
        return self.directory / "latest.pt" if self.directory else None

    def maybe_save(self, core: TrainCore) -> None:
        if not self.enabled or time.monotonic() - self._last < self.period_s:
            return
        self._last = time.monotonic()
        t0 = time.perf_counter()
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        torch.save(capture(core), tmp)
        os.replace(tmp, self.path)
        log.info("snapshot saved", step=core.progress.step, epoch=core.progress.epoch,
                 seconds=round(time.perf_counter() - t0, 3))

    def save_now(self, core: TrainCore) -> None:
        """Save regardless of the period (a drain's quiesce)."""
        self._last = float("-inf")
        self.maybe_save(core)

    def load(self) -> dict[str, Any] | None:
        if self.path is None or not self.path.exists():
            return None
        try:
            return torch.load(self.path, map_location="cpu", weights_only=False)  # type: ignore[no-any-return]
        except Exception as exc:  # noqa: BLE001 - a torn or foreign file is ignored
            log.warning("snapshot unreadable; ignoring it", path=str(self.path), error=str(exc))
            return None


def capture(core: TrainCore) -> dict[str, Any]:
    from dataclasses import asdict

    return {"model": core.model.state_dict(), "optimizer": core.optimizer.state_dict(),
            "ema": core.ema.ema.state_dict(), "ema_updates": core.ema.updates,
            "progress": asdict(core.progress), "scaler": core.scaler.state_dict(), "saved_at": time.time()}


def apply(core: TrainCore, snap: dict[str, Any]) -> None:
    core.model.load_state_dict(snap["model"])
    core.optimizer.load_state_dict(snap["optimizer"])
    core.ema.ema.load_state_dict(snap["ema"])
    core.ema.updates = snap["ema_updates"]
    world = core.progress.world
    core.progress = Progress(**snap["progress"])
    core.progress.world = world or core.progress.world
    if snap.get("scaler"):
        core.scaler.load_state_dict(snap["scaler"])
    core.sync_sampler_from_progress()


def restore_newest(core: TrainCore, snaps: LocalSnapshots) -> int | None:
    """Collective over the fresh world: every rank ends with the newest snapshot any rank holds.
    Returns the restored step, or None when no rank had one."""
    t0 = time.perf_counter()
    mine = snaps.load() if snaps.directory is not None else None
    step = int(mine["progress"]["step"]) if mine else -1
    saved_at = float(mine.get("saved_at", 0)) if mine else 0.0
    offers = hvd.allgather_object((step, saved_at), name="snapshot_offers")
    best = max(range(len(offers)), key=lambda r: offers[r])
    if offers[best][0] < 0:
        return None
    if hvd.rank() == best:
        buf = io.BytesIO()
        torch.save(mine, buf)
        payload: Any = buf.getvalue()
    else:
        payload = None
    payload = hvd.broadcast_object(payload, root_rank=best, name="snapshot_state")
    apply(core, torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False))
    log.info("restored snapshot", step=core.progress.step, epoch=core.progress.epoch, from_rank=best,
             seconds=round(time.perf_counter() - t0, 3))
    return core.progress.step
