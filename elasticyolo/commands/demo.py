"""`elasticyolo demo`: etcd + 3 local agents, a tiny Horovod job, a node killed and one added."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--epochs", type=int, default=16, help="training epochs (default 16)")
    parser.add_argument("--workdir", type=Path, default=None, help="where to put data and logs (default: a temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (agent logs, worker traces)")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.demo import run_demo

    return run_demo(epochs=args.epochs, keep=args.keep, workdir=args.workdir)
