"""`elasticyolo submit --job NAME key=value ...`: validate a TrainSpec and store it in etcd;
`--follow` then prints one status line per change until the job ends."""

from __future__ import annotations

import argparse
import getpass
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from elasticyolo.commands.connect import add_etcd_arguments, client_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_etcd_arguments(parser)
    parser.add_argument("--replace", action="store_true", help="replace a spec that is already stored")
    parser.add_argument("--follow", action="store_true",
                        help="print a status line per change until the job ends; exit 0 when it is done, "
                             "1 (with the reason) when it failed or was cancelled")
    parser.add_argument("--interval", type=float, default=1.0, metavar="S", help="--follow poll period (default 1)")
    parser.add_argument("pairs", nargs="*", metavar="KEY=VALUE",
                        help="spec options (model=, data=, epochs=, imgsz=, batch=, engine=, policy=, min_nodes=, "
                             "max_nodes=, checkpoint=, ...); data paths are read on the nodes (a path missing "
                             "here gets a warning)")


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
    from elasticyolo.engines import registry

    if (engine := registry.get(spec.engine)).cluster != "agents":
        raise UserError(f"engine={spec.engine} jobs run on a {engine.cluster} cluster, not on the agents: "
                        f"submit it with `elasticyolo {engine.cluster} submit`")
    client, keys = client_from_args(args)
    by = f"{getpass.getuser()}@{socket.gethostname()}"
    if not submit_spec(client, keys, spec, by=by, replace=args.replace):
        got = client.get(keys.state)
        state = json.loads(got[0]).get("state") if got else "submitted"
        raise UserError(f"job {keys.job!r} already has a spec (state {state}); use --replace or cancel it first")
    print(f"job {keys.job} submitted: {spec.model} on {spec.data}, {spec.epochs} epochs, engine {spec.engine}",
          flush=True)
    if (warning := local_data_warning(spec.data)) is not None:  # once submitted: an error stays one line
        print(f"elasticyolo submit: warning: {warning}", file=sys.stderr, flush=True)
    if not args.follow:
        return 0
    got = client.get(keys.spec)
    return follow(client, keys, got[1] if got else None, args.interval)


def local_data_warning(data: str) -> str | None:
    """A warning when `data=` names a local path that does not exist here (the nodes read it, so
    it may well exist there: never an error)."""
    if data.startswith("s3://") or Path(data).exists():
        return None
    return (f"data={data} does not exist on this machine; every node must have it at that path "
            "(or use data=s3://.../data.yaml, staged to each node)")


# ---- --follow -----------------------------------------------------------------------------------
# With only the step changing, a line at most this often (the step is in every line).
PROGRESS_LINE_S = 30.0


def follow_key(view: dict[str, Any]) -> tuple[Any, ...]:
    """What makes a new line: the state, world size, epoch and the newest worker error."""
    return view["state"], view.get("world_size"), view.get("epoch"), _latest_error(view)


def follow_line(view: dict[str, Any]) -> str:
    """`12:00:03  running  world 2  epoch 1  step 40  error n2: ...`."""
    parts = [time.strftime("%H:%M:%S"), view["state"]]
    for label, key in (("world", "world_size"), ("epoch", "epoch"), ("step", "step")):
        if view.get(key) is not None:
            parts.append(f"{label} {view[key]}")
    if (err := _latest_error(view)) is not None:
        parts.append(f"error {err}")
    return "  ".join(parts)


def _latest_error(view: dict[str, Any]) -> str | None:
    errors = sorted(view.get("worker_errors") or [], key=lambda e: float(e.get("at") or 0))
    return f"{errors[-1]['node']}: {errors[-1]['reason']}" if errors else None


def follow(client: Any, keys: Any, generation: int | None, interval: float) -> int:
    """Print a line per change until the job ends: 0 when done, 1 when it failed, was cancelled
    or replaced by another submission (the reason on stderr)."""
    from elasticyolo.cluster.job_state import ENDED_STATES
    from elasticyolo.errors import UnavailableError
    from elasticyolo.status import collect

    print(f"following job {keys.job} (Ctrl-C stops following, not the job)", flush=True)
    last_key: tuple[Any, ...] | None = None
    last_line_at, last_step = 0.0, None
    unreachable = False
    while True:
        try:
            view = collect(client, keys, lease_ttls=False)
        except UnavailableError as exc:
            if not unreachable:
                print(f"{time.strftime('%H:%M:%S')}  etcd unreachable, still trying: {exc}", file=sys.stderr,
                      flush=True)
            unreachable = True
            time.sleep(interval)
            continue
        unreachable = False
        if generation is not None and view.get("generation") != generation:
            print(f"elasticyolo submit: error: job {keys.job} was replaced or removed by another submission",
                  file=sys.stderr)
            return 1
        key, now = follow_key(view), time.monotonic()
        if key != last_key or (view.get("step") != last_step and now - last_line_at >= PROGRESS_LINE_S):
            print(follow_line(view), flush=True)
            last_key, last_line_at, last_step = key, now, view.get("step")
        if view["state"] in ENDED_STATES:
            if view["state"] == "done":
                print(f"job {keys.job} done", flush=True)
                return 0
            reason = view.get("reason") or _latest_error(view) or "no reason given"
            print(f"elasticyolo submit: error: job {keys.job} {view['state']}: {reason}", file=sys.stderr)
            return 1
        time.sleep(interval)
