"""The replay's accuracy check, run in a child process (the replay CLI imports no torch):

    python -m elasticyolo.chaos.evaluate epoch-end --store URI --job JOB
        prints the newest epoch-end checkpoint's epoch of JOB (or -1)
    python -m elasticyolo.chaos.evaluate map --store URI --job JOB [--job JOB2] --epoch E --data YAML
        validates each job's epoch-end checkpoint of epoch E with Ultralytics' own validator
        (`YOLO(checkpoint).val(...)`, as a user would load it) and prints one JSON object

The S3 endpoint and credentials come from the environment (AWS_ENDPOINT_URL_S3, ...).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from elasticyolo.checkpoint import catalog
from elasticyolo.checkpoint.layout import Manifest
from elasticyolo.checkpoint.stores import Store, open_store


def epoch_ends(store: Store, job: str) -> dict[int, Manifest]:
    """The job's epoch-end checkpoints by epoch (the newest of each)."""
    return {m.epoch: m for m in catalog.list_manifests(store, job) if m.epoch_end}


def validate(path: Path, data: str, imgsz: int, batch: int) -> dict[str, float]:
    import elasticyolo.train  # noqa: F401  (offline Ultralytics before anything imports it)
    from ultralytics import YOLO

    metrics = YOLO(str(path)).val(data=data, imgsz=imgsz, batch=batch, device="cpu", plots=False, verbose=False,
                                  workers=0, project=str(path.parent), name="val")
    return {"mAP50-95": round(float(metrics.box.map), 4), "mAP50": round(float(metrics.box.map50), 4)}


def evaluate(store: Store, jobs: list[str], epoch: int, data: str, imgsz: int, batch: int) -> dict[str, Any]:
    from elasticyolo.checkpoint.restore import download_verified

    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="elasticyolo-eval-") as tmp:
        for job in jobs:
            m = epoch_ends(store, job).get(epoch)
            if m is None:
                out[job] = {"error": f"no epoch-end checkpoint of epoch {epoch}"}
                continue
            path = Path(tmp) / f"{job}.pt"
            with open(path, "w+b") as f:  # verified by reading it back
                download_verified(store, m, f)
            out[job] = {"step": m.step, "epoch": m.epoch, "key": m.key, **validate(path, data, imgsz, batch)}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m elasticyolo.chaos.evaluate")
    ap.add_argument("what", choices=("epoch-end", "map"))
    ap.add_argument("--store", required=True)
    ap.add_argument("--job", action="append", required=True)
    ap.add_argument("--epoch", type=int, default=-1)
    ap.add_argument("--data", default="")
    ap.add_argument("--imgsz", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    a = ap.parse_args(argv)
    store = open_store(a.store, retries=3)
    if a.what == "epoch-end":
        print(max(epoch_ends(store, a.job[0]), default=-1))
        return 0
    print(json.dumps(evaluate(store, a.job, a.epoch, a.data, a.imgsz, a.batch)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
