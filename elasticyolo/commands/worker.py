"""`elasticyolo worker key=value ...`: one training worker, started by horovodrun or an agent."""

from __future__ import annotations

import argparse
import os
import sys

from elasticyolo.spec import TrainSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("options", nargs="*", metavar="key=value", help="the training spec (see `train`)")
    parser.add_argument("--spec-json", default=os.environ.get("ELASTICYOLO_SPEC"),
                        help="the spec as JSON (default: $ELASTICYOLO_SPEC)")
    parser.add_argument("--progress-jsonl", default=None, help="rank 0 writes one JSON record per step here")


def run(args: argparse.Namespace) -> int:
    if args.spec_json:
        spec = TrainSpec.from_json(args.spec_json, "--spec-json")
        if args.options:
            spec = TrainSpec.from_pairs(args.options, **spec.model_dump())
    else:
        spec = TrainSpec.from_pairs(args.options)
    from elasticyolo.data.yaml_check import load_data_yaml
    from elasticyolo.models import require_model

    load_data_yaml(spec.data)  # fail fast with a clear line, before torch loads
    require_model(spec.model)
    if spec.engine != "horovod":
        print(f"elasticyolo worker: error: engine={spec.engine} workers are started by torch elastic", file=sys.stderr)
        return 2
    from elasticyolo.engines.horovod.worker import run_worker
    from elasticyolo.train.report import JsonLines

    sinks = []
    if args.progress_jsonl:
        sinks.append(JsonLines(open(args.progress_jsonl, "a")))
    run_worker(spec, sinks=sinks)
    return 0
