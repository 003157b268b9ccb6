"""`elasticyolo demo`: the whole mission offline (etcd, S3 and cloud metadata on 127.0.0.1): a
tiny job on 3 spot nodes (the default engine, torch) checkpointing to S3, a spot notice drained,
a node joined, a node killed, the cost, and the run folder downloaded from the store
(docs/demo.md)."""

from __future__ import annotations

import argparse
from pathlib import Path

from elasticyolo.demo import RUN_NAME, RUN_PROJECT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=16, help="training epochs (default 16, at least 12)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="where to put data, agent logs and worker traces (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (kept anyway when the demo fails)")
    parser.add_argument("--project", type=Path, default=RUN_PROJECT,
                        help=f"where the job's run folder is downloaded to (default {RUN_PROJECT})")
    parser.add_argument("--name", default=RUN_NAME,
                        help=f"run folder name (default {RUN_NAME}; {RUN_NAME}2, ... when it exists)")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.demo import run_demo

    return run_demo(epochs=args.epochs, keep=args.keep, workdir=args.workdir, project=args.project, name=args.name)
