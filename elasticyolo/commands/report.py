"""`elasticyolo report --job J [--etcd ...] [--store URI] [--run-dir DIR] --out timeline.png`:
the job's timeline (world size, samples/s, loss, mAP over wall time; events marked). No torch."""

from __future__ import annotations

import argparse
import os

from elasticyolo.commands.connect import add_etcd_arguments
from elasticyolo.errors import UserError

STORE_ENV = "ELASTICYOLO_CHECKPOINT_STORE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--store", default=os.environ.get(STORE_ENV),
                        help=f"checkpoint store of the job: its run folder's time series and checkpoints (default ${STORE_ENV})")
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (else the AWS config chain)")
    parser.add_argument("--run-dir", default=None, help="a local run folder (elasticyolo train's runs/detect/NAME)")
    parser.add_argument("--out", default="timeline.png", help="PNG to write (default timeline.png)")


def run(args: argparse.Namespace) -> int:
    from elasticyolo.report import gather, render

    if not (args.etcd or os.environ.get("ELASTICYOLO_ETCD") or args.store or args.run_dir):
        raise UserError("nothing to read: pass --store URI and/or --etcd HOST:PORT (events), or --run-dir DIR")
    job = args.job or os.environ.get("ELASTICYOLO_JOB")
    if not job:
        raise UserError("--job is required")
    store = None
    if args.store:
        from elasticyolo.checkpoint.stores import open_store

        options = {"endpoint_url": args.endpoint_url, "retries": 3} if args.store.startswith("s3://") else {}
        store = open_store(args.store, **{k: v for k, v in options.items() if v is not None})
        store.check()
    client = keys = None
    if args.etcd or os.environ.get("ELASTICYOLO_ETCD"):
        from elasticyolo.commands.connect import client_from_args

        client, keys = client_from_args(args)
    tl = gather(job, run_dir=args.run_dir, store=store, client=client, keys=keys)
    try:
        out = render(tl, args.out, title=f"job {job}")
    except ValueError as exc:
        raise UserError(f"job {job!r}: {exc}") from None
    kinds = sorted({e["kind"] for e in tl.events})
    print(f"{out}: {len(tl.series)} samples, {len(tl.events)} events ({', '.join(kinds) or 'none'})")
    return 0
