"""`elasticyolo cancel --job NAME`: mark the job cancelled; agents stop its workers and go IDLE."""

from __future__ import annotations

import argparse
import getpass
import socket

from elasticyolo.commands.connect import add_etcd_arguments, client_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--purge", action="store_true", help="also delete the stored spec, world and progress")
    parser.add_argument("--reason", default="cancelled by operator")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.cluster.job_state import JobEvent
    from elasticyolo.cluster.jobs import set_job_state
    from elasticyolo.errors import UserError

    client, keys = client_from_args(args)
    got = client.get(keys.spec)
    if got is None:
        raise UserError(f"job {keys.job!r} has no spec in etcd (nothing to cancel)")
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    if not set_job_state(client, keys, JobEvent.CANCEL, by=by, reason=args.reason):
        raise UserError(f"job {keys.job!r} changed while cancelling; try again")
    if args.purge:
        for key in (keys.spec, keys.world, keys.progress):
            client.delete(key)
        client.delete_prefix(keys.launch_prefix)
    print(f"job {keys.job} cancelled" + (" and purged" if args.purge else ""))
    return 0
