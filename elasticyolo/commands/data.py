"""`elasticyolo data synth --out DIR`: write a small generated detection dataset."""

from __future__ import annotations

import argparse
from pathlib import Path

from elasticyolo.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    synth = sub.add_parser("synth", help="generate coloured-shape images with YOLO labels and data.yaml")
    synth.add_argument("--out", required=True, type=Path, help="output directory")
    synth.add_argument("--train", type=int, default=64, help="training images (default 64)")
    synth.add_argument("--val", type=int, default=16, help="validation images (default 16)")
    synth.add_argument("--imgsz", type=int, default=128, help="image side in pixels (default 128)")
    synth.add_argument("--classes", type=int, default=3, help="number of classes, 1..12 (default 3)")
    synth.add_argument("--seed", type=int, default=0)
    check = sub.add_parser("check", help="validate a data.yaml")
    check.add_argument("data", type=Path)


def run(args: argparse.Namespace) -> int:
    if args.action == "check":
        from elasticyolo.data.yaml_check import load_data_yaml

        data = load_data_yaml(args.data)
        print(f"{args.data}: ok, {data['nc']} classes, train={data['train']} val={data['val']}")
        return 0
    from elasticyolo.data.synth import SynthSpec, write_dataset

    try:
        spec = SynthSpec(train=args.train, val=args.val, imgsz=args.imgsz, classes=args.classes, seed=args.seed)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if args.out.exists() and not args.out.is_dir():
        raise UserError(f"--out {args.out}: exists and is not a directory")
    try:
        path = write_dataset(args.out, spec)
    except OSError as exc:
        from elasticyolo.cli import os_error_text

        raise UserError(f"--out {args.out}: cannot write the dataset: {os_error_text(exc)}") from None
    print(f"wrote {spec.train} train + {spec.val} val images ({spec.classes} classes, {spec.imgsz}px): {path}")
    return 0
