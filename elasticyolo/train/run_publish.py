"""The run folder of a cluster job: written on the node of rank 0 (`<work dir>/<job>/`) and
published next to the job's checkpoints in the store (`<job>/run/...`, `checkpoint/layout.py`),
so it survives the node; `elasticyolo checkpoints download --run` copies the whole folder to a
machine (`checkpoint/run_download.py`). Uploads run on one background thread: an epoch end never
waits for S3.

Whichever process holds rank 0 writes it (results.csv comes from the synced history); `best.pt`
in the store is only replaced by an epoch that is the best so far (or when there is none yet),
so a new rank 0 never overwrites the real best with its first epoch.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from elasticyolo.checkpoint.layout import run_key
from elasticyolo.log import get_logger
from elasticyolo.train.run_folder import RunFolder
from elasticyolo.train.timeline import TimelineSink

if TYPE_CHECKING:
    from elasticyolo.train.core import TrainCore

log = get_logger("elasticyolo.run_publish")


class RunPublisher:
    def __init__(self, store: Any, job: str) -> None:
        self.store, self.job = store, job
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-publish")
        self._pending: list[Future[None]] = []
        self._lock = threading.Lock()

    def upload(self, path: Path, rel: str) -> None:
        data = path.read_bytes()  # read now: the file may be rewritten before the upload runs

        def put() -> None:
            try:
                self.store.put_bytes(run_key(self.job, rel), data)
            except Exception as exc:  # noqa: BLE001 - best effort: the next epoch publishes again
                log.warning("run folder upload failed", key=run_key(self.job, rel), error=str(exc))

        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + [self._pool.submit(put)]

    def has(self, rel: str) -> bool:
        try:
            return self.store.head(run_key(self.job, rel)) is not None
        except Exception:  # noqa: BLE001
            return False

    def on_epoch(self, folder: RunFolder, improved: bool) -> None:
        self.upload(folder.args_yaml, "args.yaml")
        self.upload(folder.csv, "results.csv")
        self.upload(folder.last_pt, "weights/last.pt")
        if improved or not self.has("weights/best.pt"):
            self.upload(folder.best_pt, "weights/best.pt")
        if folder.epoch_pt is not None:  # save_period
            self.upload(folder.epoch_pt, f"weights/{folder.epoch_pt.name}")

    def finish(self, folder: RunFolder, extra: list[Path] = (), timeout: float = 120.0) -> None:  # type: ignore[assignment]
        for path in [folder.dir / "results.png", *extra]:
            if path.exists():
                self.upload(path, path.name)
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            f.result(timeout=timeout)
        self._pool.shutdown(wait=True)


class ClusterRunFolder:
    """Rank 0's progress sink for the run folder, created the first time this process is rank 0."""

    def __init__(self, core: "TrainCore", job: str, store: Any | None, root: Path) -> None:
        self.core, self.job = core, job
        self.publisher = RunPublisher(store, job) if store is not None else None
        self.root = root
        self.folder: RunFolder | None = None
        self.timeline: TimelineSink | None = None

    def sinks(self) -> list[Any]:
        """[] unless this process holds rank 0 now."""
        if self.core.rank != 0:
            return []
        if self.folder is None:
            self.folder = RunFolder(self.root / self.job, self.core,
                                    {"job": self.job, **self.core.spec.model_dump(mode="json")},
                                    on_epoch=self._on_epoch)
            self.timeline = TimelineSink(self.folder.dir)
        return [self.timeline, self.folder]

    def _on_epoch(self, folder: RunFolder, improved: bool) -> None:
        if self.publisher is not None:
            self.publisher.on_epoch(folder, improved)
            if self.timeline is not None:
                self.publisher.upload(self.timeline.path, f"timeline/{self.timeline.path.name}")

    def finish(self) -> None:
        """At the job's end on rank 0: results.png, and every upload landed."""
        if self.folder is None or self.core.rank != 0:
            return
        try:
            self.folder.plot()
        except Exception as exc:  # noqa: BLE001 - a plot must not fail a finished job
            log.warning("results.png not written", error=str(exc))
        extra: list[Path] = []
        if self.timeline is not None:
            self.timeline.close()
            if self.publisher is not None:
                self.publisher.upload(self.timeline.path, f"timeline/{self.timeline.path.name}")
            png = write_timeline(self.folder.dir, self.job, self.publisher.store if self.publisher else None)
            extra += [png] if png else []
        if self.publisher is not None:
            self.publisher.finish(self.folder, extra)


def write_timeline(run_dir: Path, job: str, store: Any | None = None) -> Path | None:
    """timeline.png of the run at its end (the job's event log too when this process can reach etcd)."""
    from elasticyolo.report import gather, render
    from elasticyolo.worker_runtime import worker_env

    try:
        found = worker_env.read().etcd_client(timeout=2.0)
        client, keys = found if found is not None else (None, None)
        tl = gather(job, run_dir=run_dir, store=store, client=client, keys=keys)
        return render(tl, run_dir / "timeline.png", title=f"job {job}")
    except Exception as exc:  # noqa: BLE001 - a plot must not fail a finished job
        log.warning("timeline.png not written", error=str(exc))
        return None
