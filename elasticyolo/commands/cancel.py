"""`elasticyolo cancel --job NAME`: mark the job cancelled; agents stop its workers and go IDLE."""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import time

from elasticyolo.commands.connect import add_etcd_arguments, client_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--purge", action="store_true", help="also delete the stored spec, world and progress")
    parser.add_argument("--reason", default="cancelled by operator")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.cluster.keys import JOB_CANCELLED
    from elasticyolo.errors import UserError

    client, keys = client_from_args(args)
    got = client.get(keys.spec)
    if got is None:
        raise UserError(f"job {keys.job!r} has no spec in etcd (nothing to cancel)")
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    ok, _ = client.compare_and_swap(keys.state, json.dumps({"state": JOB_CANCELLED, "at": time.time(), "by": by,
                                                              "reason": args.reason}),
                                    _mod_revision(client, keys.state))
    if not ok:
        raise UserError(f"job {keys.job!r} changed while cancelling; try again")
    if args.purge:
        for key in (keys.spec, keys.world, keys.progress):
            client.delete(key)
        client.delete_prefix(keys.launch_prefix)
    print(f"job {keys.job} cancelled" + (" and purged" if args.purge else ""))
    return 0


def _mod_revision(client, key: str) -> int:  # type: ignore[no-untyped-def]
    got = client.get(key)
    return got[1] if got else 0
