"""`elasticyolo train key=value ...`: train in this process (single node, no etcd)."""

from __future__ import annotations

import argparse
import sys

from elasticyolo.spec import TrainSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("options", nargs="*", metavar="key=value",
                        help="model=yolov8n.yaml data=PATH epochs=E imgsz=S batch=B lr0=... policy=...")
    parser.add_argument("--progress-jsonl", type=argparse.FileType("w"), default=None,
                        help="also write one JSON record per step to this file")
    parser.add_argument("--job", default="train",
                        help="job name for checkpoints (with checkpoint=URI a rerun resumes this job)")
    parser.add_argument("--save", default=None, help="write the final checkpoint (.pt, loads with YOLO(path)) here")


def run(args: argparse.Namespace) -> int:
    spec = TrainSpec.from_pairs(args.options)
    from elasticyolo.data.yaml_check import load_data_yaml
    from elasticyolo.models import require_model

    from elasticyolo.data.staging import resolve_for_spec

    resolve_for_spec(spec)  # an s3:// dataset is staged into the local cache first
    load_data_yaml(spec.data)  # fail fast with a clear line, before torch loads
    require_model(spec.model)
    from elasticyolo.train.core import TrainCore, quiet_ultralytics
    from elasticyolo.train.loop import TrainingLoop
    from elasticyolo.train.report import JsonLines, ProgressBar

    from elasticyolo.train.checkpointing import Checkpointer, LocalHooks

    quiet_ultralytics()
    core = TrainCore(spec)
    checkpointer = Checkpointer(spec, args.job, rank=0)
    if checkpointer.restore_into(core):
        core.set_world(1, 0)
        print(f"resumed from checkpoint: epoch={core.progress.epoch} step={core.progress.step}", file=sys.stderr)
    sinks = []
    bar = ProgressBar(spec.epochs, core.sampler.num_samples) if sys.stderr.isatty() else None
    if bar:
        sinks.append(bar)
    if args.progress_jsonl:
        sinks.append(JsonLines(args.progress_jsonl))
    summary = TrainingLoop(core, hooks=LocalHooks(core, checkpointer), sinks=sinks).run()
    core.close()
    if bar:
        bar.close()
    if checkpointer.enabled and not checkpointer.save_now(core, reason="final"):
        print("elasticyolo train: warning: the final checkpoint did not land in time", file=sys.stderr)
    checkpointer.close()
    if args.save:
        from elasticyolo.train.state import save_checkpoint_file

        save_checkpoint_file(core, args.save)
    m = summary.metrics
    print(
        f"done: epochs={summary.epochs} steps={summary.steps} images={summary.images} "
        f"mAP50={m.get('mAP50', 0.0):.3f} mAP50-95={m.get('mAP50-95', 0.0):.3f} seconds={summary.seconds:.1f}"
    )
    return 0
