"""`elasticyolo status`: the job's world (nodes, leader, progress, checkpoint). No torch."""

from __future__ import annotations

import argparse
import json
import sys
import time

from elasticyolo.cluster.connect import add_etcd_arguments, client_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--watch", action="store_true", help="refresh until interrupted")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S", help="--watch refresh period (default 2)")
    parser.add_argument("--lease-ttl", choices=["auto", "always", "never"], default="auto",
                        help="per-node lease TTL lookups (one request each): auto = up to 100 nodes")


_TTL_MODE = {"auto": None, "always": True, "never": False}


def run(args: argparse.Namespace) -> int:
    from elasticyolo.status import collect, render_table

    client, keys = client_from_args(args)
    if not args.watch:
        view = collect(client, keys, lease_ttls=_TTL_MODE[args.lease_ttl])
        print(json.dumps(view, sort_keys=True) if args.json else render_table(view))
        return 0
    from elasticyolo.errors import UnavailableError

    try:
        while True:
            try:
                view = collect(client, keys, lease_ttls=_TTL_MODE[args.lease_ttl])
                out = json.dumps(view, sort_keys=True) if args.json else render_table(view)
            except UnavailableError as exc:
                out = f"elasticyolo status: {exc}"
            if args.json:
                print(out, flush=True)  # one object per line: easy to pipe into jq
            else:
                sys.stdout.write("\x1b[H\x1b[2J" if sys.stdout.isatty() else "\n")
                sys.stdout.write(f"{time.strftime('%H:%M:%S')}  every {args.interval:g}s\n{out}\n")
                sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
