"""Fine-tuning benchmark: does a job really start from the weights it is given?

On generated data, through 2 real agents (etcd, Horovod workers, yolov8n) and a local S3 API
server (moto on 127.0.0.1), one epoch of training starting

  (a) from the architecture, `model=yolov8n.yaml` (what a job without weights trains), and
  (b) from weights in S3, `model=s3://bench/weights.pt`: yolov8n trained for `--pretrain-epochs`
      epochs on another generated set of the same classes (other images, other seed);
  (c) with `--freeze N`, also (b) with `freeze=N`.

All with the same options (`--options`, default a fine-tuning learning rate: `optimizer=AdamW
lr0=0.0002`). Every run validates on the same val split at the end of its epoch; prints
mAP50-95 (and mAP50) of each, of the weights as given (no training), and the ratio (b) / (a).

    .venv/bin/python bench/finetune.py [--pretrain-epochs 12] [--imgsz 128] [--freeze 10] [--options "..."]
                                       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import boto3

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.agents import ELASTICYOLO
from elasticyolo.local_cluster.servers import EtcdCluster, S3Server

BUCKET = "bench"


def pretrain(data: Path, epochs: int, imgsz: int, out: Path) -> float:
    """Weights from `elasticyolo train` (one process); returns the seconds it took."""
    t0 = time.time()
    # One optimizer step per batch of 8 and no mosaic (at 128 px it shrinks the objects below what
    # a few dozen steps learn): as tests/test_learning.py, which reaches mAP50 ~0.7 in 12 epochs.
    r = subprocess.run([ELASTICYOLO, "train", "model=yolov8n.yaml", f"data={data}", f"epochs={epochs}",
                        f"imgsz={imgsz}", "batch=8", "nbs=8", f"close_mosaic={epochs}", "warmup_epochs=1",
                        "val=false", "--save", str(out)],
                       capture_output=True, text=True, cwd=out.parent)
    if r.returncode != 0:
        raise SystemExit(f"pretraining failed:\n{r.stderr[-3000:]}")
    return time.time() - t0


def as_given(weights: Path, data: Path, imgsz: int, workdir: Path) -> dict[str, Any]:
    """The weights' own mAP on the val split, before any training."""
    from elasticyolo.spec import TrainSpec
    from elasticyolo.train.core import TrainCore, quiet_ultralytics

    quiet_ultralytics()
    core = TrainCore(TrainSpec.from_pairs([f"model={weights}", f"data={data}", f"imgsz={imgsz}", "batch=8",
                                           "workers=0"]), work_dir=workdir / "as-given")
    metrics = core.validate()
    core.close()
    return {"mAP50-95": metrics["mAP50-95"], "mAP50": metrics["mAP50"]}


def one_epoch(etcd: EtcdCluster, workdir: Path, job: str, pairs: list[str]) -> dict[str, Any]:
    """One epoch through two agents; the metrics of its end-of-epoch validation."""
    (workdir / job).mkdir()
    c = AgentCluster(etcd.endpoints, job, workdir / job, env={"OMP_NUM_THREADS": "1"})
    try:
        for node in ("a", "b"):
            c.start(node, "--data-cache-dir", str(workdir / job / f"cache-{node}"))
        c.wait(lambda: c.ready(["a", "b"]) and c.leader(), 60, "two agents and a leader")
        t0 = time.time()
        c.submit(*pairs)
        c.wait(lambda: c.job_state() in ("done", "failed"), 1800, f"{job} to finish")
        if c.job_state() != "done":
            raise SystemExit(f"{job} failed: {c.status().get('events')}")
        worlds = {e["world"] for e in c.steps()}
        metrics = c.progress().get("metrics") or {}
        return {"mAP50-95": float(metrics.get("mAP50-95", 0.0)), "mAP50": float(metrics.get("mAP50", 0.0)),
                "seconds": round(time.time() - t0, 1), "worlds": sorted(worlds)}
    finally:
        c.stop()


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    data = write_dataset(workdir / "data", SynthSpec(train=64, val=16, imgsz=args.imgsz, classes=3, seed=0))
    other = write_dataset(workdir / "other", SynthSpec(train=64, val=4, imgsz=args.imgsz, classes=3, seed=1))
    weights = workdir / "weights.pt"
    pretrain_s = pretrain(other, args.pretrain_epochs, args.imgsz, weights)
    common = [f"data={data}", "epochs=1", f"imgsz={args.imgsz}", "batch=8", "nbs=8", "close_mosaic=1",
              "warmup_epochs=0", "val=true", "min_nodes=2", "amp=false", "gloo_timeout_s=30", *args.options.split()]
    with EtcdCluster(size=1) as etcd, S3Server() as s3:
        os.environ.update(s3.env())  # the agents and their workers reach the store with these
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        boto3.client("s3").upload_file(str(weights), BUCKET, "weights.pt")
        uri = f"s3://{BUCKET}/weights.pt"
        out: dict[str, Any] = {"pretrain_epochs": args.pretrain_epochs, "pretrain_s": round(pretrain_s, 1),
                               "imgsz": args.imgsz, "weights": uri, "options": args.options,
                               "as_given": as_given(weights, data, args.imgsz, workdir)}
        out["from_yaml"] = one_epoch(etcd, workdir, "bench-ft-yaml", ["model=yolov8n.yaml", *common])
        out["from_weights"] = one_epoch(etcd, workdir, "bench-ft-weights", [f"model={uri}", *common])
        if args.freeze:
            out["from_weights_frozen"] = one_epoch(etcd, workdir, "bench-ft-frozen",
                                                   [f"model={uri}", f"freeze={args.freeze}", *common])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pretrain-epochs", type=int, default=12, help="epochs that make the weights")
    ap.add_argument("--imgsz", type=int, default=128)
    ap.add_argument("--freeze", type=int, default=0, help="also fine-tune with freeze=N (0: not)")
    ap.add_argument("--options", default="optimizer=AdamW lr0=0.0002", help="key=value options of every run")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-finetune-") as tmp:
        out = run(args, Path(tmp))
    print(f"fine-tuning: 2 agents, yolov8n, 64 generated images at {args.imgsz} px (16 to validate), "
          f"one epoch each; weights: {args.pretrain_epochs} epochs on another generated set "
          f"({out['pretrain_s']} s, one process), from {out['weights']}; options: {args.options}")
    print(f"{'start':<28}{'mAP50-95':>10}{'mAP50':>8}{'seconds':>9}")
    rows = [("(the weights, untrained)", out["as_given"]), ("model=yolov8n.yaml", out["from_yaml"]),
            ("model=s3://.../weights.pt", out["from_weights"])]
    if "from_weights_frozen" in out:
        rows.append((f"  + freeze={args.freeze}", out["from_weights_frozen"]))
    for name, r in rows:
        print(f"{name:<28}{r['mAP50-95']:>10.4f}{r['mAP50']:>8.4f}{r.get('seconds', '-'):>9}")
    a, b = out["from_yaml"]["mAP50-95"], out["from_weights"]["mAP50-95"]
    out["ratio"] = round(b / a, 1) if a > 0 else (float("inf") if b > 0 else None)
    print(f"fine-tuned / from yaml (mAP50-95): {out['ratio']}x" if a > 0 else
          f"fine-tuned / from yaml (mAP50-95): inf (one epoch from the yaml detects nothing: 0; fine-tuned {b:.4f})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if b > a else 1


if __name__ == "__main__":
    sys.exit(main())
