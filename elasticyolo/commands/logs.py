"""`elasticyolo logs JOB [--node N] [--follow] [--tail N]`: a job's agent and worker logs, read from
the job's store, where every agent ships them (`agent/log_shipping.py`). No torch, no ssh."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable

from elasticyolo.commands.connect import add_etcd_arguments, client_from_args

# Fields a log line shows in its prefix (node, time, level) or not at all.
_HIDDEN = {"event", "level", "timestamp", "node", "job", "logger"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_name", nargs="?", metavar="JOB", help="job name (or --job, env ELASTICYOLO_JOB)")
    parser.add_argument("--node", metavar="N", help="only this node's logs")
    parser.add_argument("--follow", "-f", action="store_true",
                        help="print new lines as they arrive, until the job ends (or Ctrl-C)")
    parser.add_argument("--tail", type=int, default=-1, metavar="N", help="the last N lines of each node (default: all)")
    parser.add_argument("--raw", action="store_true", help="the lines as stored (JSON records), each after its node")
    parser.add_argument("--interval", type=float, default=2.0, metavar="S", help="--follow poll period (default 2)")
    parser.add_argument("--store", metavar="URI",
                        help="the job's store (default: the checkpoint= of the job's spec in etcd)")
    add_etcd_arguments(parser)


@dataclass(frozen=True)
class Segment:
    node: str
    started_ms: int
    seq: int
    key: str
    size: int


class LogReader:
    """A job's shipped log segments in a store, read once (`tail`) or as they grow (`new_lines`)."""

    def __init__(self, store: Any, job: str, node: str | None = None) -> None:
        self.store, self.job, self.node = store, job, node
        self._seen: dict[str, tuple[int, int]] = {}  # key -> (size, lines already returned)

    @property
    def found(self) -> bool:
        """Whether any segment was seen."""
        return bool(self._seen)

    def segments(self) -> dict[str, list[Segment]]:
        from elasticyolo.agent.log_shipping import logs_prefix, parse_segment_key

        prefix = logs_prefix(self.job) + (f"{self.node}/" if self.node else "")
        by_node: dict[str, list[Segment]] = {}
        for info in self.store.list(prefix):
            parsed = parse_segment_key(self.job, info.key)
            if parsed is not None:
                by_node.setdefault(parsed[0], []).append(Segment(*parsed, info.key, info.size))
        return {n: sorted(segs, key=lambda s: (s.started_ms, s.seq)) for n, segs in sorted(by_node.items())}

    def _lines(self, seg: Segment) -> list[str]:
        from elasticyolo.checkpoint.stores import NotFound

        try:
            return self.store.get_bytes(seg.key).decode("utf-8", "replace").splitlines()
        except NotFound:
            return []

    def tail(self, n: int) -> list[tuple[Segment, str]]:
        """Every node's last `n` lines (n < 0: all), remembering what was read. Older segments
        are read only as far as needed (sealed, they never change); each node's newest is always
        read, as it may still grow."""
        out: list[tuple[Segment, str]] = []
        for segs in self.segments().values():
            picked: list[tuple[Segment, str]] = []
            for i, seg in enumerate(reversed(segs)):
                if i > 0 and 0 <= n <= len(picked):
                    self._seen[seg.key] = (seg.size, 0)
                    continue
                lines = self._lines(seg)
                self._seen[seg.key] = (seg.size, len(lines))
                picked = [(seg, line) for line in lines] + picked
            out += picked if n < 0 else picked[len(picked) - min(n, len(picked)):]
        return out

    def new_lines(self) -> list[tuple[Segment, str]]:
        """Lines shipped since the last call (a segment is rewritten as it grows)."""
        out: list[tuple[Segment, str]] = []
        for segs in self.segments().values():
            for seg in segs:
                size, done = self._seen.get(seg.key, (-1, 0))
                if size == seg.size:
                    continue
                lines = self._lines(seg)
                self._seen[seg.key] = (seg.size, len(lines))
                out += [(seg, line) for line in lines[done:]]
        return out


# ---- rendering ----------------------------------------------------------------------------------
def _record(line: str) -> dict[str, Any] | None:
    if not line.startswith("{"):
        return None
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    return rec if isinstance(rec, dict) and "event" in rec else None


def _when(rec: dict[str, Any] | None) -> float | None:
    ts = rec.get("timestamp") if rec else None
    if not isinstance(ts, str):
        return None
    try:
        return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _value(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v)
    return json.dumps(text) if (not text or any(c.isspace() for c in text)) and isinstance(v, str) else text


def render(node: str, line: str, raw: bool = False) -> str:
    """`n1  12:00:01.250  info     worker started  slot=0 pid=123`; lines that are not JSON
    records (a process's plain output) as they are."""
    rec = None if raw else _record(line)
    if rec is None:
        return f"{node}  {line}"
    when = _when(rec)
    clock = datetime.fromtimestamp(when).strftime("%H:%M:%S.%f")[:-3] if when is not None else "-"
    fields = "  ".join(f"{k}={_value(v)}" for k, v in rec.items() if k not in _HIDDEN)
    return f"{node}  {clock}  {str(rec.get('level', 'info')):<7}  {rec['event']}" + (f"  {fields}" if fields else "")


def ordered(lines: Iterable[tuple[Segment, str]]) -> list[tuple[str, str]]:
    """(node, line) in time order across nodes; a line without a timestamp keeps its place after
    the line before it (a traceback after its record)."""
    keyed = []
    for i, (seg, line) in enumerate(lines):
        when = _when(_record(line))
        prev = keyed[-1] if keyed and keyed[-1][2] == seg.key else None
        t = when if when is not None else (prev[0] if prev is not None else seg.started_ms / 1000)
        keyed.append((t, i, seg.key, seg.node, line))
    return [(node, line) for _t, _i, _key, node, line in sorted(keyed, key=lambda k: (k[0], k[1]))]


# ---- the command --------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> int:
    from elasticyolo.errors import UnavailableError, UserError

    if args.job_name:
        args.job = args.job_name
    if args.node:
        from elasticyolo.cluster.keys import check_node_id

        check_node_id(args.node)
    client, keys = (None, None)
    try:
        client, keys = client_from_args(args)
    except UserError:
        if not (args.store and (args.job_name or args.job)):
            raise
    job = keys.job if keys is not None else str(args.job)
    store = _store(args, client, keys, job)
    reader = LogReader(store, job, args.node)
    first = ordered(reader.tail(args.tail))
    if not first and not reader.found:
        who = f"node {args.node} of job {job}" if args.node else f"job {job}"
        print(f"elasticyolo logs: no logs of {who} in {store.uri} (yet)", file=sys.stderr)
    _print(first, args.raw)
    if not args.follow:
        return 0
    quiet_after_end = 0
    while True:
        time.sleep(args.interval)
        new = ordered(reader.new_lines())
        _print(new, args.raw)
        ended = False
        if client is not None and keys is not None:
            try:
                ended = _job_ended(client, keys)
            except UnavailableError:
                ended = False
        # The agents ship a job's last lines within a flush period of its end: two quiet polls.
        quiet_after_end = quiet_after_end + 1 if ended and not new else 0
        if quiet_after_end >= 2:
            return 0


def _print(lines: list[tuple[str, str]], raw: bool) -> None:
    for node, line in lines:
        print(render(node, line, raw))
    sys.stdout.flush()


def _job_ended(client: Any, keys: Any) -> bool:
    got = client.get(keys.state)
    from elasticyolo.cluster.job_state import ENDED_STATES

    return bool(got) and json.loads(got[0]).get("state") in ENDED_STATES


def _store(args: argparse.Namespace, client: Any, keys: Any, job: str) -> Any:
    """The store named by --store, else the job spec's `checkpoint=` (with its S3 options)."""
    from elasticyolo.checkpoint.stores import open_store
    from elasticyolo.errors import UserError
    from elasticyolo.s3options import s3_options

    spec = None
    if args.store:
        uri = args.store
    else:
        got = client.get(keys.spec)
        if got is None:
            raise UserError(f"job {job!r} has no spec in etcd: pass --store URI to read logs it shipped before")
        from elasticyolo.spec import TrainSpec

        spec = TrainSpec.from_json(got[0], where=f"job {job!r} spec")
        uri = spec.checkpoint
        if not uri:
            raise UserError(f"job {job!r} has no store (checkpoint=): agents ship logs to the job's store; "
                            "without one, read a node's journal (journalctl -u elasticyolo-agent)")
    store = open_store(uri, **s3_options(uri, spec))
    store.check()
    return store
