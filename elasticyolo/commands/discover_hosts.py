"""`elasticyolo discover-hosts`: print `host:slots` lines of the job's live, non-draining nodes,
for `horovodrun --host-discovery-script` (the agents' own driver reads etcd in-process instead).

Bounded: one etcd read with a short timeout; on failure it exits non-zero quickly (Horovod keeps
its last host list on a failed discovery) rather than hang.
"""

from __future__ import annotations

import argparse
import json

from elasticyolo.commands.connect import add_etcd_arguments, client_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--max-slots", type=int, default=None, help="cap the slots per node")
    parser.add_argument("--use", choices=["addr", "node-id", "host"], default="addr",
                        help="what to print as the host name (default: the node's advertised address)")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.engines.horovod.discovery import slots_of  # torch-free

    client, keys = client_from_args(args, retry_window=min(2.0, float(args.etcd_timeout or 2.0)))
    lines = []
    for key, value, _ in client.get_prefix(keys.nodes):
        try:
            rec = json.loads(value)
        except ValueError:
            continue
        n = slots_of(rec, args.max_slots)
        if n > 0:
            name = {"addr": rec.get("addr"), "host": rec.get("host"), "node-id": rec.get("node_id")}[args.use]
            lines.append(f"{name or keys.node_id_of(key)}:{n}")
    print("\n".join(sorted(lines)))
    return 0
