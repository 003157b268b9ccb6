"""Ultralytics' run outputs in a run folder (`run_layout.save_dir`: `runs/detect/train`, ...):
args.yaml, results.csv (Ultralytics' column names), results.png (Ultralytics' own `plot_results`),
weights/last.pt, weights/best.pt (by Ultralytics' fitness) and weights/epoch{N}.pt every
`save_period` epochs.

A progress sink on the rank that reports (rank 0). The rows come from the per-epoch history the
training loop keeps in its synced state (losses, metrics, LRs, time), so an epoch trained again
after a rollback replaces its row, and a new rank 0 (or a restart) writes the same file.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from elasticyolo.log import get_logger
from elasticyolo.train.fitness import best_epoch

if TYPE_CHECKING:
    from elasticyolo.train.core import TrainCore

log = get_logger("elasticyolo.run_folder")

# Our metric names -> Ultralytics' results.csv columns (detection, box "(B)").
METRIC_COLUMNS = {"precision": "metrics/precision(B)", "recall": "metrics/recall(B)",
                  "mAP50": "metrics/mAP50(B)", "mAP50-95": "metrics/mAP50-95(B)"}
ARGS_FILE, RESULTS_CSV, RESULTS_PNG = "args.yaml", "results.csv", "results.png"


def results_rows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """results.csv rows from the per-epoch history (`Progress.history`, kept in every checkpoint and
    synced across ranks, so any rank 0, even after a restart, writes the whole file). Ultralytics'
    column order: epoch, time, train losses, metrics, val losses, lr per param group; `epoch` counts
    finished epochs (Ultralytics' `epoch + 1`). Unvalidated epochs get 0 metrics, as Ultralytics."""
    by_epoch = {int(h["epoch"]): h for h in history}  # an epoch trained again replaces its entry
    rows = []
    for e in sorted(by_epoch):
        h = by_epoch[e]
        train = {k: float(v) for k, v in h.items() if k.startswith("train/")}
        names = [k.removeprefix("train/") for k in train]
        row: dict[str, Any] = {"epoch": e + 1, "time": float(h.get("time", 0.0)), **train}
        row.update({col: float(h.get(key, 0.0)) for key, col in METRIC_COLUMNS.items()})
        row.update({f"val/{k}": float(h.get(f"val/{k}", 0.0)) for k in names})
        row.update({k: float(v) for k, v in sorted(h.items(), key=lambda kv: _pg(kv[0])) if k.startswith("lr/pg")})
        rows.append(row)
    return rows


def results_csv(history: list[dict[str, Any]]) -> str:
    rows = results_rows(history)
    if not rows:
        return ""
    columns: list[str] = []
    for r in rows:
        columns += [c for c in r if c not in columns]
    lines = [",".join(columns)] + [",".join(_num(r.get(c, 0.0)) for c in columns) for r in rows]
    return "\n".join(lines) + "\n"


def _pg(key: str) -> int:
    return int(key.removeprefix("lr/pg")) if key.removeprefix("lr/pg").isdigit() else 0


class RunFolder:
    """Writes the run folder as training goes: a progress sink of the reporting rank. At each
    epoch end: results.csv (from the history), weights/last.pt, best.pt when this epoch is the
    best so far, epoch{N}.pt every `save_period` epochs, then `on_epoch(self, improved)`.

    The training thread only copies the weights to host memory (`snapshot(core)`, default
    `train.state.build_core_checkpoint`); serializing, writing and `on_epoch` run on one
    background thread, in epoch order, so an epoch end does not stall the world (on the training thread it would cost rank 0
    0.3-0.5 s per epoch on 2 CPU cores). `flush()` waits for them."""

    MAX_PENDING = 2  # epochs whose files are still being written; the next epoch end waits beyond

    def __init__(self, save_dir: str | Path, core: "TrainCore", args: dict[str, Any],
                 snapshot: Callable[["TrainCore"], Any] | None = None,
                 on_epoch: Callable[["RunFolder", bool], None] | None = None) -> None:
        self.dir = Path(save_dir)
        self.weights = self.dir / "weights"
        self.weights.mkdir(parents=True, exist_ok=True)
        self.core = core
        self.spec = core.spec
        if snapshot is None:
            from elasticyolo.train.state import build_core_checkpoint as snapshot
        self._snapshot = snapshot
        self.on_epoch = on_epoch  # e.g. publish the files next to the job's checkpoints
        self.csv = self.dir / RESULTS_CSV
        self.args_yaml = self.dir / ARGS_FILE
        _atomic_write(self.args_yaml, yaml.safe_dump(args, sort_keys=False).encode())
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="run-folder")
        self._pending: list[Future[None]] = []
        self.epoch_pt: Path | None = None  # weights/epoch{N}.pt written at the epoch end `on_epoch` is called for

    @property
    def last_pt(self) -> Path:
        return self.weights / "last.pt"

    @property
    def best_pt(self) -> Path:
        return self.weights / "best.pt"

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec.get("kind") == "step" and rec.get("epoch_ended"):
            self.end_epoch()

    def end_epoch(self) -> None:
        history = self.core.progress.history
        if not history:
            return
        csv = results_csv(history)
        best = best_epoch(history)
        improved = best is None or best[0] == int(history[-1]["epoch"])  # this epoch is the best so far
        finished = int(history[-1]["epoch"]) + 1
        weights = self._snapshot(self.core)
        self._pending = [f for f in self._pending if not f.done()]
        while len(self._pending) >= self.MAX_PENDING:
            self._pending.pop(0).result()
        self._pending.append(self._writer.submit(self._write_epoch, csv, weights, improved, finished))

    def _write_epoch(self, csv: str, weights: Any, improved: bool, finished: int) -> None:
        from elasticyolo.train.state import write_checkpoint_file

        try:
            _atomic_write(self.csv, csv.encode())
            write_checkpoint_file(weights, self.last_pt)
            if improved or not self.best_pt.exists():
                _copy(self.last_pt, self.best_pt)
            self.epoch_pt = None
            if self.spec.save_period > 0 and finished % self.spec.save_period == 0:
                self.epoch_pt = self.weights / f"epoch{finished}.pt"
                _copy(self.last_pt, self.epoch_pt)
            if self.on_epoch is not None:
                self.on_epoch(self, improved)
        except Exception as exc:  # noqa: BLE001 - the run folder is a copy; training goes on
            log.warning("run folder not written", epoch=finished, error=str(exc))

    def flush(self, timeout: float | None = 120.0) -> None:
        """Wait until every finished epoch's files are written."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result(timeout=timeout)

    def plot(self) -> Path | None:
        """results.png with Ultralytics' `plot_results` (as its trainer does at the end of a run)."""
        self.flush()
        if not self.csv.exists():
            return None
        from ultralytics.utils.plotting import plot_results

        plot_results(file=self.csv)
        png = self.dir / RESULTS_PNG
        return png if png.exists() else None


def _num(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
