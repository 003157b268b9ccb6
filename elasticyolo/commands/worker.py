"""`elasticyolo worker key=value ...`: one training worker, started by an agent, by torch elastic
or by horovodrun. The spec's `engine` picks the worker entry point (`engines/registry.py`)."""

from __future__ import annotations

import argparse

from elasticyolo.worker_runtime.worker_env import ENV_SPEC, wait_prewarm_delay


def add_arguments(parser: argparse.ArgumentParser) -> None:
    import os

    parser.add_argument("options", nargs="*", metavar="key=value", help="the training spec (see `train`)")
    parser.add_argument("--spec-json", default=os.environ.get(ENV_SPEC),
                        help=f"the spec as JSON (default: ${ENV_SPEC})")
    parser.add_argument("--progress-jsonl", default=None, help="rank 0 writes one JSON record per step here")
    parser.add_argument("--prewarm-slot", type=int, default=None, metavar="N",
                        help="(agent use) build the model and data for local slot N, print READY, "
                             "then wait for the engine's environment as one JSON line on stdin")


def on_error(args: argparse.Namespace, message: str, code: int) -> None:
    """The worker's fatal error (the line the CLI prints) for its agent, which publishes it to the
    job (`worker_runtime/worker_errors.py`)."""
    from elasticyolo.worker_runtime.worker_errors import record

    record(message, code, slot=args.prewarm_slot)


def run(args: argparse.Namespace) -> int:
    from elasticyolo.worker_runtime.lifeline import die_with_agent

    die_with_agent()  # started by an agent (or its torch launcher): die with it
    if args.prewarm_slot is not None:
        wait_prewarm_delay()  # before the imports below
    from elasticyolo.data.yaml_check import load_data_yaml
    from elasticyolo.engines import registry
    from elasticyolo.engines.base import WorkerOptions
    from elasticyolo.spec import TrainSpec

    if args.spec_json:
        spec = TrainSpec.from_json(args.spec_json, "--spec-json")
        if args.options:
            spec = TrainSpec.from_pairs(args.options, **spec.model_dump())
    else:
        spec = TrainSpec.from_pairs(args.options)
    load_data_yaml(spec.data)
    engine = registry.get(spec.engine)
    return int(engine.worker_main(spec, WorkerOptions(progress_jsonl=args.progress_jsonl,
                                                      prewarm_slot=args.prewarm_slot)) or 0)
