"""The run's time series for `elasticyolo report`: rank 0 samples its progress records (at most
one row every `period_s`, plus every epoch end) into `timeline/<start>-<pid>.jsonl` in the run
folder. Each process that held rank 0 writes its own file, so a run that moved between nodes has
several; `elasticyolo.report` merges them by time. Torch-free."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

TIMELINE_DIR = "timeline"


class TimelineSink:
    def __init__(self, run_dir: str | Path, period_s: float = 2.0) -> None:
        self.dir = Path(run_dir) / TIMELINE_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"{int(time.time() * 1000):015d}-{os.getpid()}.jsonl"
        self.period_s = period_s
        self._last = 0.0
        self._fh = open(self.path, "a", buffering=1)

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec.get("kind") != "step":
            return
        now = time.time()
        if not rec.get("epoch_ended") and now - self._last < self.period_s:
            return
        self._last = now
        row = {"t": round(now, 3), "step": rec.get("step"), "epoch": rec.get("epoch"),
               "epoch_frac": _epoch_frac(rec), "world": rec.get("world_size"),
               "samples_s": round(float(rec.get("samples_per_s") or 0.0), 3), "loss": rec.get("loss")}
        metrics = rec.get("metrics") or {}
        if rec.get("epoch_ended") and "mAP50-95" in metrics:
            row.update({"mAP50": metrics.get("mAP50"), "mAP50-95": metrics["mAP50-95"]})
        self._fh.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._fh.close()


def _epoch_frac(rec: dict[str, Any]) -> float | None:
    n = rec.get("num_samples")
    if not n or rec.get("epoch") is None:
        return None
    return round(float(rec["epoch"]) + float(rec.get("consumed") or 0) / float(n), 4)
