"""`elasticyolo checkpoints list|show|download|prune --job NAME [--store URI]`.

Manifests only (no torch): list/show/prune read JSON manifests, download copies bytes and checks
their sha256 against the manifest; `download --run` copies the job's whole run folder
(`checkpoint/run_download.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from elasticyolo.errors import UserError

STORE_ENV = "ELASTICYOLO_CHECKPOINT_STORE"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--job", required=True, help="job name")
    common.add_argument("--store", default=os.environ.get(STORE_ENV),
                        help=f"s3://bucket/prefix or file:///path (default: ${STORE_ENV})")
    common.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint (else the AWS config chain)")
    common.add_argument("--profile", default=None, help="AWS profile")
    common.add_argument("--region", default=None, help="AWS region")
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)

    p = sub.add_parser("list", parents=[common], help="list checkpoints, oldest first")
    p.add_argument("--json", action="store_true", help="one JSON array of manifests")

    p = sub.add_parser("show", parents=[common], help="print one manifest as JSON")
    p.add_argument("which", nargs="?", default="latest", help="latest (default), a step, or a name from list")

    p = sub.add_parser("download", parents=[common],
                       help="download a checkpoint .pt (sha256-checked), best.pt, or the whole run folder")
    p.add_argument("which", nargs="?", default="latest", help="latest (default), a step, or a name from list")
    p.add_argument("-o", "--output", default=None,
                   help="file or directory (default: ./<job>-step<N>.pt, with --best ./<job>-best.pt); with --run "
                        "the folder to write (default: runs/detect/<name>, the next free one, as Ultralytics)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--best", action="store_true",
                       help="the run's best.pt by Ultralytics' fitness (<job>/run/weights/best.pt; loads with "
                            "YOLO(path))")
    which.add_argument("--run", action="store_true",
                       help="the job's whole run folder (<job>/run/: args.yaml, results.csv, results.png, "
                            "timeline.png, weights/...), laid out as Ultralytics'")

    p = sub.add_parser("prune", parents=[common], help="apply retention now")
    p.add_argument("--keep-last", type=int, required=True, help="keep the newest K checkpoints")
    p.add_argument("--keep-epochs", action="store_true", help="also keep every epoch-end checkpoint")
    p.add_argument("--orphan-grace-s", type=float, default=3600.0,
                   help="delete objects without a manifest once this old (uploads may be in flight)")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted")


def _store(args: argparse.Namespace) -> Any:
    from elasticyolo.checkpoint.stores import open_store

    if not args.store:
        raise UserError(f"no checkpoint store: pass --store s3://bucket/prefix (or file:///path) or set {STORE_ENV}")
    options: dict[str, Any] = {}
    if args.store.startswith("s3://"):
        options = {k: v for k, v in (("endpoint_url", args.endpoint_url), ("profile", args.profile),
                                     ("region", args.region)) if v}
        options["retries"] = 3
    store = open_store(args.store, **options)
    store.check()
    return store


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def _age(created: float) -> str:
    s = max(0.0, time.time() - created)
    return f"{s:.0f}s" if s < 120 else f"{s / 60:.0f}m" if s < 7200 else f"{s / 3600:.1f}h"


def run(args: argparse.Namespace) -> int:
    from elasticyolo.checkpoint import layout
    from elasticyolo.checkpoint.stores.base import Store

    layout.check_job(args.job)
    store: Store = _store(args)
    try:
        return _ACTIONS[args.action](store, args)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - one line for store errors
        explain = getattr(store, "explain", None)
        if explain is not None:
            raise explain(exc) from None
        raise UserError(f"checkpoint store {store.uri}: {type(exc).__name__}: {exc}") from None


def _list(store: Any, args: argparse.Namespace) -> int:
    from dataclasses import asdict

    from elasticyolo.checkpoint import catalog

    manifests = catalog.list_manifests(store, args.job)
    latest = catalog.read_latest(store, args.job)
    if args.json:
        out = [{**asdict(m), "name": m.name, "latest": bool(latest and latest.name == m.name)} for m in manifests]
        json.dump(out, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return 0
    if not manifests:
        print(f"job {args.job!r} has no checkpoints in {store.uri}")
        return 0
    rows = [("", "STEP", "EPOCH", "E.STEP", "WORLD", "SIZE", "AGE", "UPLOAD", "REASON", "NAME")]
    for m in manifests:
        mark = "*" if latest and latest.name == m.name else ""
        rows.append((mark, str(m.step), str(m.epoch) + ("e" if m.epoch_end else ""), str(m.epoch_step),
                     str(m.world_size), _human(m.size), _age(m.created), f"{m.upload_s:.2f}s", m.reason, m.name))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    return 0


def _show(store: Any, args: argparse.Namespace) -> int:
    from elasticyolo.checkpoint import catalog

    m = catalog.find(store, args.job, args.which)
    sys.stdout.write(m.to_json().decode() + "\n")
    return 0


def _download(store: Any, args: argparse.Namespace) -> int:
    from elasticyolo.checkpoint import catalog
    from elasticyolo.checkpoint.restore import CorruptCheckpoint, download_verified

    if args.best or args.run:
        if args.which != "latest":
            raise UserError(f"{'--best' if args.best else '--run'} and {args.which!r} both given: pick one")
        return _download_best(store, args) if args.best else _download_run(store, args)
    m = catalog.find(store, args.job, args.which)
    try:
        out = _write_atomically(args.output, f"{args.job}-step{m.step}.pt", lambda f: download_verified(store, m, f))
    except CorruptCheckpoint as exc:
        raise UserError(f"checkpoint {m.name} of job {args.job!r} is corrupt: {exc}") from None
    print(f"{out}  step {m.step}  epoch {m.epoch}  {_human(m.size)}  sha256 {m.sha256[:16]}.. verified")
    return 0


def _write_atomically(output: str | None, default_name: str, write: Callable[[Any], None]) -> Path:
    """`write(f)` into `output` (a file, a folder, or None: `default_name` here) through a hidden
    `.part` file renamed into place, so a failed download never leaves a partial file."""
    out = Path(output) if output else Path(default_name)
    if out.is_dir():
        out = out / default_name
    tmp = out.with_name(f".{out.name}.part")
    try:
        with open(tmp, "wb+") as f:
            write(f)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _download_best(store: Any, args: argparse.Namespace) -> int:
    """The run folder's weights/best.pt (published by rank 0 at each better epoch)."""
    from elasticyolo.checkpoint.layout import run_key

    key = run_key(args.job, "weights/best.pt")
    info = store.head(key)
    if info is None:
        raise UserError(f"job {args.job!r} has no best.pt in {store.uri} (written at the first epoch end; "
                        f"`checkpoints download` gets the latest checkpoint)")

    def fetch(f: Any) -> None:
        store.download(key, f)
        if f.tell() != info.size:
            raise UserError(f"{store.uri}/{key}: got {f.tell()} bytes, the store lists {info.size}; try again")

    out = _write_atomically(args.output, f"{args.job}-best.pt", fetch)
    print(f"{out}  best.pt of job {args.job}  {_human(info.size)}")
    return 0


def _download_run(store: Any, args: argparse.Namespace) -> int:
    from elasticyolo.checkpoint.run_download import download_run

    got = download_run(store, args.job, args.output)
    print(f"{got.dest}  run folder of job {args.job}  {len(got.files)} files  {_human(got.size)}")
    return 0


def _prune(store: Any, args: argparse.Namespace) -> int:
    from elasticyolo.checkpoint import catalog

    if args.keep_last < 1:
        raise UserError("--keep-last must be at least 1")
    r = catalog.prune(store, args.job, keep_last=args.keep_last, keep_epochs=args.keep_epochs,
                      orphan_grace_s=args.orphan_grace_s, dry_run=args.dry_run)
    verb = "would delete" if args.dry_run else "deleted"
    for key in r.manifests + r.objects:
        print(f"{verb} {key}")
    print(f"{verb} {len(r.manifests)} checkpoints, {len(r.objects)} objects")
    return 0


_ACTIONS = {"list": _list, "show": _show, "download": _download, "prune": _prune}
