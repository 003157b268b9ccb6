"""`elasticyolo data synth|check|stage|upload`: generate, validate, stage from S3, upload to S3."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from elasticyolo.errors import UserError


def _s3_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("S3 (defaults: ELASTICYOLO_S3_*, then the AWS configuration)")
    g.add_argument("--endpoint-url", dest="s3_endpoint_url", help="S3-compatible endpoint")
    g.add_argument("--region", dest="s3_region")
    g.add_argument("--profile", dest="s3_profile")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    synth = sub.add_parser("synth", help="generate coloured-shape images with YOLO labels and data.yaml")
    synth.add_argument("--out", required=True, type=Path, help="output directory")
    synth.add_argument("--train", type=int, default=64, help="training images (default 64)")
    synth.add_argument("--val", type=int, default=16, help="validation images (default 16)")
    synth.add_argument("--imgsz", type=int, default=128, help="image side in pixels (default 128)")
    synth.add_argument("--classes", type=int, default=3, help="number of classes, 1..12 (default 3)")
    synth.add_argument("--seed", type=int, default=0)
    check = sub.add_parser("check", help="validate a data.yaml (an s3:// one is staged first)")
    check.add_argument("data")
    stage = sub.add_parser("stage", help="stage s3://bucket/prefix/data.yaml into this node's dataset cache")
    stage.add_argument("uri", help="s3://bucket/prefix/data.yaml")
    stage.add_argument("--cache", help="cache directory (default: $ELASTICYOLO_DATA_CACHE, $CACHE_DIRECTORY/datasets, "
                                       "~/.cache/elasticyolo/datasets)")
    stage.add_argument("--max-gb", type=float, help="cache size cap: least recently used datasets are evicted")
    stage.add_argument("--concurrency", type=int, default=16, help="parallel transfers (default 16)")
    stage.add_argument("--json", action="store_true", help="print the result as JSON")
    _s3_arguments(stage)
    upload = sub.add_parser("upload", help="upload a local dataset directory to s3://bucket/prefix")
    upload.add_argument("dir", type=Path, help="the dataset directory (holding data.yaml)")
    upload.add_argument("uri", help="s3://bucket/prefix")
    upload.add_argument("--concurrency", type=int, default=16)
    upload.add_argument("--sse", dest="s3_sse", choices=["AES256", "aws:kms"], help="server-side encryption")
    upload.add_argument("--kms-key-id", dest="s3_kms_key_id")
    _s3_arguments(upload)


def _options(args: argparse.Namespace, uri: str) -> dict[str, object]:
    from elasticyolo.s3options import s3_options

    return s3_options(uri, args)


def run(args: argparse.Namespace) -> int:
    if args.action == "check":
        from elasticyolo.data.yaml_check import load_data_yaml

        data = load_data_yaml(args.data)
        print(f"{args.data}: ok, {data['nc']} classes, train={data['train']} val={data['val']}")
        return 0
    if args.action == "stage":
        from elasticyolo import log
        from elasticyolo.staging.cache import DatasetCache
        from elasticyolo.staging.stager import Stager

        log.configure("warning")
        cache = DatasetCache.from_settings(args.cache, args.max_gb)
        result = Stager(cache, _options(args, args.uri), max_concurrency=args.concurrency).stage(args.uri)
        if args.json:
            print(json.dumps({"data_yaml": str(result.path), **result.as_record()}))
        else:
            print(f"{args.uri}: {'cached' if result.reused else 'staged'} {result.files} files "
                  f"({result.bytes / 1e6:.1f} MB, fetched {result.downloaded_bytes / 1e6:.1f} MB) in "
                  f"{result.seconds:.1f}s: {result.path}")
        return 0
    if args.action == "upload":
        from elasticyolo.staging.upload import upload_dataset

        n, size, seconds = upload_dataset(args.dir, args.uri, _options(args, args.uri), args.concurrency)
        print(f"uploaded {n} files ({size / 1e6:.1f} MB) to {args.uri} in {seconds:.1f}s: "
              f"train with data={args.uri.rstrip('/')}/data.yaml")
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
