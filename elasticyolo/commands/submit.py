"""`elasticyolo submit --job NAME key=value ...`: validate a TrainSpec and store it in etcd."""

from __future__ import annotations

import argparse
import getpass
import json
import socket

from elasticyolo.cluster.connect import add_etcd_arguments, client_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--replace", action="store_true", help="replace a spec that is already stored")
    parser.add_argument("pairs", nargs="*", metavar="KEY=VALUE",
                        help="spec options (model=, data=, epochs=, imgsz=, batch=, engine=, policy=, min_nodes=, "
                             "max_nodes=, checkpoint=, ...); data paths are checked on the nodes, not here")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.cluster.jobs import submit_spec
    from elasticyolo.errors import UserError
    from elasticyolo.spec import TrainSpec

    if not args.pairs:
        raise UserError("no spec given: pass key=value options, at least data=...")
    spec = TrainSpec.from_pairs(args.pairs)  # validated before any connection: a bad spec writes nothing
    if spec.resume:
        raise UserError(f"resume={spec.resume}: a cluster job resumes by itself from its checkpoint store "
                        "(checkpoint=URI; resubmit with --replace and the same job name)")
    client, keys = client_from_args(args)
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    if not submit_spec(client, keys, spec, by=by, replace=args.replace):
        got = client.get(keys.state)
        state = json.loads(got[0]).get("state") if got else "submitted"
        raise UserError(f"job {keys.job!r} already has a spec (state {state}); use --replace or cancel it first")
    print(f"job {keys.job} submitted: {spec.model} on {spec.data}, {spec.epochs} epochs, engine {spec.engine}")
    return 0
