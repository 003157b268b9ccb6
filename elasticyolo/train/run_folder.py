"""Ultralytics' run outputs: `<project>/<name>/` with args.yaml, results.csv (Ultralytics' column
names), results.png (Ultralytics' own `plot_results`), weights/last.pt, weights/best.pt (by
Ultralytics' fitness) and weights/epoch{N}.pt every `save_period` epochs.

A progress sink on the rank that reports (rank 0): it sums the step records' loss components over
the epoch, and at each epoch end writes the row and the weights. Rows are keyed by epoch, so an
epoch trained again after a rollback replaces its row instead of adding one.
"""

from __future__ import annotations

import csv
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import yaml

from elasticyolo.train.fitness import best_epoch

if TYPE_CHECKING:
    from elasticyolo.train.core import TrainCore

# Our metric names -> Ultralytics' results.csv columns (detection, box "(B)").
METRIC_COLUMNS = {"precision": "metrics/precision(B)", "recall": "metrics/recall(B)",
                  "mAP50": "metrics/mAP50(B)", "mAP50-95": "metrics/mAP50-95(B)"}
ARGS_FILE, RESULTS_CSV, RESULTS_PNG = "args.yaml", "results.csv", "results.png"


def new_run_dir(project: str | Path, name: str, exist_ok: bool = False) -> Path:
    """`project/name`, or `name2`, `name3`, ... when it exists (Ultralytics' `increment_path`)."""
    path = Path(project) / name
    if exist_ok or not path.exists():
        return path
    n = 2
    while (Path(project) / f"{name}{n}").exists():
        n += 1
    return Path(project) / f"{name}{n}"


def latest_last_pt(project: str | Path) -> Path | None:
    """The newest `*/weights/last.pt` under `project` (Ultralytics' `get_latest_run`)."""
    found = list(Path(project).glob("*/weights/last.pt"))
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def read_rows(path: Path) -> dict[int, dict[str, str]]:
    if not path.exists():
        return {}
    with open(path, newline="") as fh:
        return {int(float(row["epoch"])): row for row in csv.DictReader(fh) if row.get("epoch")}


class RunFolder:
    """Writes the run folder as training goes. `save_weights(core, path)` writes a checkpoint file
    (`train.state.save_checkpoint_file`); injected so this module needs no torch."""

    def __init__(self, save_dir: str | Path, core: "TrainCore", args: dict[str, Any],
                 save_weights: Callable[[Any, Path], None] | None = None,
                 on_epoch: Callable[["RunFolder"], None] | None = None) -> None:
        self.dir = Path(save_dir)
        self.weights = self.dir / "weights"
        self.weights.mkdir(parents=True, exist_ok=True)
        self.core = core
        self.spec = core.spec
        if save_weights is None:
            from elasticyolo.train.state import save_checkpoint_file as save_weights
        self._save_weights = save_weights
        self.on_epoch = on_epoch  # e.g. publish the files to the checkpoint store
        self.csv = self.dir / RESULTS_CSV
        self.rows = read_rows(self.csv)
        last_time = max((float(r.get("time") or 0) for r in self.rows.values()), default=0.0)
        self._t0 = time.time() - last_time  # a resumed run keeps counting its time
        self._loss_sum: dict[str, float] = {}
        self._loss_n = 0
        self._lrs: list[float] = []
        _atomic_write(self.dir / ARGS_FILE, yaml.safe_dump(args, sort_keys=False).encode())

    @property
    def last_pt(self) -> Path:
        return self.weights / "last.pt"

    @property
    def best_pt(self) -> Path:
        return self.weights / "best.pt"

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec.get("kind") != "step":
            return
        n = int(rec.get("accumulate") or 1)
        for k, v in (rec.get("loss_items") or {}).items():
            self._loss_sum[k] = self._loss_sum.get(k, 0.0) + float(v) * n
        self._loss_n += n
        self._lrs = list(rec.get("lrs") or self._lrs)
        if rec.get("epoch_ended"):
            self.end_epoch(int(rec["epoch"]), rec.get("metrics") or {})

    def row(self, epoch: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """One results.csv row in Ultralytics' column order: epoch, time, train losses, metrics,
        val losses, lr per param group. `epoch` counts finished epochs (Ultralytics' `epoch + 1`)."""
        train = {f"train/{k}": v / max(self._loss_n, 1) for k, v in self._loss_sum.items()}
        names = [k.removeprefix("train/") for k in train]
        row: dict[str, Any] = {"epoch": epoch, "time": round(time.time() - self._t0, 3), **train}
        row.update({col: float(metrics.get(key, 0.0)) for key, col in METRIC_COLUMNS.items()})
        row.update({f"val/{k}": float(metrics.get(f"val/{k}", 0.0)) for k in names})
        row.update({f"lr/pg{i}": lr for i, lr in enumerate(self._lrs)})
        return row

    def end_epoch(self, epoch: int, metrics: dict[str, Any]) -> None:
        row = self.row(epoch, metrics)
        self._loss_sum, self._loss_n = {}, 0
        self.rows[epoch] = {k: _num(v) for k, v in row.items()}
        self._write_csv()
        self._save_weights(self.core, self.last_pt)
        best = best_epoch(self.core.progress.history)
        # epoch e (0-based) ended -> history holds {"epoch": e}; the row is e + 1.
        if best is None or best[0] == epoch - 1 or not self.best_pt.exists():
            _copy(self.last_pt, self.best_pt)
        if self.spec.save_period > 0 and epoch % self.spec.save_period == 0:
            _copy(self.last_pt, self.weights / f"epoch{epoch}.pt")
        if self.on_epoch is not None:
            self.on_epoch(self)

    def _write_csv(self) -> None:
        columns: list[str] = []
        for r in self.rows.values():
            columns += [c for c in r if c not in columns]
        lines = [",".join(columns)]
        for epoch in sorted(self.rows):
            r = self.rows[epoch]
            lines.append(",".join(str(r.get(c, "")) for c in columns))
        _atomic_write(self.csv, ("\n".join(lines) + "\n").encode())

    def plot(self) -> Path | None:
        """results.png with Ultralytics' `plot_results` (as its trainer does at the end of a run)."""
        if not self.rows:
            return None
        from ultralytics.utils.plotting import plot_results

        plot_results(file=self.csv)
        png = self.dir / RESULTS_PNG
        return png if png.exists() else None

    def files(self) -> list[Path]:
        """The run folder's files, for publishing (weights last)."""
        out = [p for p in (self.dir / ARGS_FILE, self.csv, self.dir / RESULTS_PNG) if p.exists()]
        return out + sorted(p for p in self.weights.glob("*.pt"))


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
