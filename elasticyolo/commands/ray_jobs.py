"""`elasticyolo ray submit|status|cancel`: a job on a Ray cluster (engine=ray, docs/ray-engine.md).
`--address HOST:PORT` names the head node's GCS; without it, the cluster this host is part of.
No torch here (the training actors import it)."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from typing import Any

from elasticyolo.worker_runtime.worker_env import DEFAULT_WORK_ROOT


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="the Ray head node's GCS address (default: the cluster this host runs a node of)")
    p.add_argument("--job", required=True, help="job name")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("submit", help="start a job on the Ray cluster")
    _common(p)
    p.add_argument("--cpus-per-slot", type=float, default=1.0, help="CPUs of each training actor (default 1)")
    p.add_argument("--gpus-per-slot", type=float, default=None,
                   help="GPUs of each training actor (default: 1 where the cluster has GPUs, else 0)")
    p.add_argument("--work-dir", default=DEFAULT_WORK_ROOT, help="node-local snapshots and run folders")
    p.add_argument("--spot-provider", default="none", help="spot notices on every node: auto, aws, gcp, azure, none")
    p.add_argument("--notice-file", default=None,
                   help="a file whose appearance is a spot notice ({node} is replaced by the node's name)")
    p.add_argument("--wait-for-nodes", action="store_true",
                   help="start even when fewer than min_nodes have room now (an autoscaling cluster)")
    p.add_argument("pairs", nargs="*", metavar="KEY=VALUE", help="spec options, as `elasticyolo submit` takes")
    p = sub.add_parser("status", help="the job's world, progress and checkpoint")
    _common(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p = sub.add_parser("cancel", help="stop the job")
    _common(p)
    p.add_argument("--reason", default="cancelled by operator")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.engines.ray import job
    from elasticyolo.errors import UserError

    if args.action == "submit":
        if not args.pairs:
            raise UserError("no spec given: pass key=value options, at least data=...")
        notices: dict[str, Any] = {}
        if args.spot_provider != "none":
            notices["provider"] = args.spot_provider
        if args.notice_file:
            notices["notice_file"] = args.notice_file
        where = job.submit(args.pairs, args.job, address=args.address, work_root=args.work_dir,
                           cpus_per_slot=args.cpus_per_slot, gpus_per_slot=args.gpus_per_slot, notices=notices,
                           wait_for_nodes=args.wait_for_nodes)
        print(f"job {args.job} submitted to the Ray cluster: controller on node {where['node']}, "
              f"{where['nodes_with_room']} node(s) with room for its slots", flush=True)
        return 0
    if args.action == "status":
        from elasticyolo.status import render_table

        view = job.status(args.job, address=args.address)
        if args.json:
            print(json.dumps(view, sort_keys=True))
        else:
            tty = sys.stdout.isatty()
            print(render_table(view, color=tty, width=shutil.get_terminal_size().columns if tty else None))
        return 0
    if not job.cancel(args.job, address=args.address, reason=args.reason):
        raise UserError(f"job {args.job!r} is not running on this Ray cluster")
    print(f"job {args.job} cancelled")
    return 0
