"""What checkpointing costs the training loop: steps/s with checkpoints every N steps vs none.

One TrainCore, one process; rounds alternate (with checkpoints, without, with, ...) so machine
noise hits both alike. Checkpoints go to a real S3 API (moto_server on 127.0.0.1, at nice 19
since in production S3 is not on the training node) through the production CheckpointManager. Also prints the blocking snapshot time per checkpoint against the
background upload time (serialize + hash + upload + verify).

    .venv/bin/python bench/checkpoint_stall.py [--interval 200 --steps 200 --rounds 3 --imgsz 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import boto3

import elasticyolo.train  # noqa: F401
import torch

from elasticyolo.checkpoint import CheckpointManager, list_manifests, open_store
from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.spec import TrainSpec
from elasticyolo.testing.servers import S3Server
from elasticyolo.train.core import TrainCore, quiet_ultralytics
from elasticyolo.train.state import build_core_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=int, default=200, help="save_period_steps (default: the spec default)")
    ap.add_argument("--steps", type=int, default=200, help="steps per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--imgsz", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()
    torch.set_num_threads(2)
    quiet_ultralytics()
    tmp = Path(tempfile.mkdtemp(prefix="ckpt-stall-"))
    data = write_dataset(tmp / "data", SynthSpec(train=128, val=4, imgsz=args.imgsz, classes=2))
    spec = TrainSpec.from_pairs([f"data={data}", "model=yolov8n.yaml", "epochs=10000", f"imgsz={args.imgsz}",
                                 f"batch={args.batch}", f"nbs={args.batch}", "val=false", "close_mosaic=0",
                                 "warmup_epochs=0"])
    core = TrainCore(spec, work_dir=tmp / "run")
    with S3Server() as s3:
        import os

        # In production S3 is another machine; here moto shares the two cores with training, so
        # it runs at the lowest priority to charge the training node only for its own work
        # (snapshot, serialize, hash, send).
        assert s3.proc is not None
        os.setpriority(os.PRIO_PROCESS, s3.proc.pid, 19)
        os.environ.update(s3.env())
        boto3.client("s3", endpoint_url=s3.endpoint_url).create_bucket(Bucket="bench")
        store = open_store("s3://bench/stall")
        mgr = CheckpointManager(store, "bench", save_period_steps=args.interval, save_period_s=0, keep_last=2)

        def run(n: int, checkpoint: bool) -> float:
            t = time.perf_counter()
            for _ in range(n):
                core.train_step()
                core.end_epoch_if_done()
                if checkpoint:
                    mgr.maybe_save(core.progress.step, core.progress.epoch, lambda: build_core_checkpoint(core))
            return n / (time.perf_counter() - t)

        run(3, False)  # warm-up
        ratios = []
        print(f"{'round':>5} {'with ckpt steps/s':>18} {'without steps/s':>16} {'ratio':>7}")
        for r in range(args.rounds):
            a = run(args.steps, True)
            b = run(args.steps, False)
            ratios.append(a / b)
            print(f"{r:>5} {a:>18.3f} {b:>16.3f} {a / b:>7.3f}")
        mgr.close(timeout=120)
        manifests = list_manifests(store, "bench")
    snap = [m.snapshot_s for m in manifests]
    up = [m.upload_s for m in manifests]
    print(f"median ratio with/without = {statistics.median(ratios):.3f} (checkpoint every {args.interval} steps, "
          f"{args.steps} steps x {args.rounds} rounds, imgsz {args.imgsz}, batch {args.batch}; target >= 0.99)")
    if snap:
        print(f"per checkpoint ({len(snap)} kept, {manifests[-1].size / 1e6:.1f} MB): blocking snapshot "
              f"{statistics.median(snap):.3f} s vs background upload {statistics.median(up):.3f} s (medians)")


if __name__ == "__main__":
    main()
