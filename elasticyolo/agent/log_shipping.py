"""The agent's log, workers' output included, shipped to the job's store, where `elasticyolo logs`
reads it (docs/operations.md says why shipped rather than served by each agent).

What: every line the agent writes to its log stream (`log.add_tap`): its own records, its
workers' output that it re-logs (`spawn.pump_output`) and the torch launcher's and its workers'
output that it forwards (`spawn.forward_output`). The journal gets the same lines.

Where: the job's checkpoint store (`checkpoint=`), next to its checkpoints and run folder:

    <root>/<job>/logs/<node-id>/<agent start ms:013d>-<segment:06d>.log

One agent run writes segments of up to `SEGMENT_BYTES`; the open segment is rewritten whole
every `FLUSH_S` while it grows (a store has no append), then sealed and the next one begins. So
a node's lines reach the store within about `FLUSH_S`, a dead node's stay there, and a node costs
one small PUT per `FLUSH_S` at most. Lines written before the job named a store (or while the
store fails) are held, up to `HELD_SEGMENTS` segments, and shipped once it answers.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elasticyolo import log as logging_setup
from elasticyolo.agent.plugin import AgentPlugin

if TYPE_CHECKING:
    from elasticyolo.agent.job import JobView
    from elasticyolo.agent.plugin import NodeAPI

SEGMENT_BYTES = 256 * 1024
FLUSH_S = 2.0
HELD_SEGMENTS = 8  # sealed, not yet shipped segments kept (the oldest go first)
MAX_LINE_CHARS = 16 * 1024
STOP_FLUSH_S = 5.0  # the agent's exit waits at most this long for the last upload

_SEGMENT_RE = re.compile(r"^(?P<node>[^/]+)/(?P<started>\d{13})-(?P<seq>\d{6})\.log$")


def logs_prefix(job: str) -> str:
    return f"{job}/logs/"


def segment_key(job: str, node_id: str, started_ms: int, seq: int) -> str:
    return f"{logs_prefix(job)}{node_id}/{started_ms:013d}-{seq:06d}.log"


def parse_segment_key(job: str, key: str) -> tuple[str, int, int] | None:
    """`(node, agent start ms, segment)` of a segment's key; None for anything else."""
    m = _SEGMENT_RE.match(key[len(logs_prefix(job)):]) if key.startswith(logs_prefix(job)) else None
    return (m["node"], int(m["started"]), int(m["seq"])) if m else None


@dataclass
class Segment:
    seq: int
    lines: list[str] = field(default_factory=list)
    size: int = 0
    version: int = 0  # lines added so far
    shipped_version: int = -1  # the version the store holds (-1: none)

    def data(self) -> bytes:
        return "".join(f"{line}\n" for line in self.lines).encode("utf-8", "replace")


class SegmentBuffer:
    """Lines in segments: the open one and the sealed ones not yet shipped (thread-safe)."""

    def __init__(self, segment_bytes: int = SEGMENT_BYTES, held: int = HELD_SEGMENTS) -> None:
        self.segment_bytes, self.held = segment_bytes, held
        self.current = Segment(0)
        self.sealed: list[Segment] = []
        self.dropped = 0  # segments dropped unshipped (no store for too long)
        self._lock = threading.Lock()

    def add(self, line: str) -> None:
        line = line if len(line) <= MAX_LINE_CHARS else line[:MAX_LINE_CHARS] + "…"
        n = len(line.encode("utf-8", "replace")) + 1
        with self._lock:
            cur = self.current
            if cur.lines and cur.size + n > self.segment_bytes:
                if cur.shipped_version != cur.version:
                    self.sealed.append(cur)
                    if len(self.sealed) > self.held:
                        self.sealed.pop(0)
                        self.dropped += 1
                cur = self.current = Segment(cur.seq + 1)
            cur.lines.append(line)
            cur.size += n
            cur.version += 1

    def unshipped(self) -> list[tuple[Segment, int, bytes]]:
        """(segment, version, bytes) to write: the sealed ones, then the open one if it changed."""
        with self._lock:
            out = [(s, s.version, s.data()) for s in self.sealed]
            cur = self.current
            if cur.version != cur.shipped_version and cur.lines:
                out.append((cur, cur.version, cur.data()))
            return out

    def shipped(self, segment: Segment, version: int) -> None:
        with self._lock:
            segment.shipped_version = version
            if segment in self.sealed and segment.version == version:
                self.sealed.remove(segment)

    def reship(self) -> None:
        """A new store: the open segment goes there whole."""
        with self._lock:
            self.current.shipped_version = -1


class LogShipper(AgentPlugin):
    """The agent plug-in: taps the log from its creation, ships from its own thread (the agent loop
    never waits for the store), and ships the last lines when the agent stops."""

    def __init__(self, node_id: str, job: str, started_at: float, *, flush_s: float = FLUSH_S,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        self.node_id, self.job = node_id, job
        self.started_ms = int(started_at * 1000)
        self.flush_s = flush_s
        self.buffer = SegmentBuffer(segment_bytes)
        self.log = logging_setup.get_logger("elasticyolo.log_shipping", node=node_id, job=job)
        self._target: tuple[str, dict[str, Any]] | None = None  # (store URI, open_store options)
        self._store: Any = None
        self._store_uri: str | None = None
        self._failing = False
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="log-shipping", daemon=True)
        logging_setup.add_tap(self.buffer.add)

    # ---- plug-in callbacks (agent loop thread) ------------------------------------------------
    def on_start(self, agent: "NodeAPI") -> None:
        self._thread.start()

    def on_job_change(self, agent: "NodeAPI", job: "JobView") -> None:
        from elasticyolo.s3options import s3_options

        uri = job.spec.checkpoint if job.spec is not None else None
        if uri and (self._target is None or self._target[0] != uri):
            self._target = (uri, s3_options(uri, job.spec))
            self._wake.set()

    def on_stop(self, agent: "NodeAPI") -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(STOP_FLUSH_S)
        logging_setup.remove_tap(self.buffer.add)

    # ---- shipping (its own thread) -------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.flush_s)
            self._wake.clear()
            self.flush()
        self.flush()  # the lines of the agent's stop

    def flush(self) -> bool:
        """Write what changed since the last flush. False when there is no store or it failed."""
        store = self._open_store()
        if store is None:
            return False
        try:
            for segment, version, data in self.buffer.unshipped():
                store.put_bytes(segment_key(self.job, self.node_id, self.started_ms, segment.seq), data,
                                content_type="text/plain; charset=utf-8")
                self.buffer.shipped(segment, version)
        except Exception as exc:  # noqa: BLE001 - logs are best effort; the next flush retries
            if not self._failing:  # once per outage: this warning is a log line to ship too
                self.log.warning("could not ship logs to the job's store; will retry", store=self._store_uri,
                                 error=str(exc))
            self._failing = True
            return False
        if self._failing:
            self.log.info("shipping logs again", store=self._store_uri)
        self._failing = False
        return True

    def _open_store(self) -> Any:
        target = self._target
        if target is None:
            return None
        if self._store is None or self._store_uri != target[0]:
            from elasticyolo.checkpoint.stores import open_store

            try:
                self._store = open_store(target[0], **target[1])
            except Exception as exc:  # noqa: BLE001 - a bad URI fails the workers, not the agent
                if not self._failing:
                    self.log.warning("cannot open the job's store for logs", store=target[0], error=str(exc))
                self._failing = True
                return None
            if self._store_uri is not None:
                self.buffer.reship()
            self._store_uri = target[0]
        return self._store

