"""`elasticyolo worker key=value ...`: one training worker, started by horovodrun or an agent."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from elasticyolo.spec import TrainSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("options", nargs="*", metavar="key=value", help="the training spec (see `train`)")
    parser.add_argument("--spec-json", default=os.environ.get("ELASTICYOLO_SPEC"),
                        help="the spec as JSON (default: $ELASTICYOLO_SPEC)")
    parser.add_argument("--progress-jsonl", default=None, help="rank 0 writes one JSON record per step here")
    parser.add_argument("--prewarm-slot", type=int, default=None, metavar="N",
                        help="(agent use) build the model and data for local slot N, print READY, then wait for "
                             "the Horovod environment as one JSON line on stdin")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.engines.horovod import pdeathsig

    pdeathsig.arm_from_env()  # started by an agent: die with it
    if args.spec_json:
        spec = TrainSpec.from_json(args.spec_json, "--spec-json")
        if args.options:
            spec = TrainSpec.from_pairs(args.options, **spec.model_dump())
    else:
        spec = TrainSpec.from_pairs(args.options)
    from elasticyolo.data.yaml_check import load_data_yaml

    load_data_yaml(spec.data)
    if spec.engine != "horovod":
        print(f"elasticyolo worker: error: engine={spec.engine} workers are started by torch elastic", file=sys.stderr)
        return 2

    def make_sinks() -> list[Any]:
        from elasticyolo.train.report import JsonLines

        sinks: list[Any] = []
        if args.progress_jsonl:
            sinks.append(JsonLines(open(args.progress_jsonl, "a")))
        if os.environ.get("ELASTICYOLO_ETCD_PROGRESS") == "1":
            from elasticyolo.engines.progress import EtcdProgress

            sink = EtcdProgress.from_env()
            if sink is not None:
                sinks.append(sink)
        return sinks

    if args.prewarm_slot is not None:
        from elasticyolo.engines.horovod.prewarm import serve

        return serve(args.prewarm_slot, make_sinks)
    from elasticyolo.engines.horovod.worker import run_worker

    run_worker(spec, sinks=make_sinks())
    return 0
