"""Host discovery for Horovod's `ElasticDriver`, read from etcd (no script, no SSH).

`ClusterView` polls the job's `nodes/` and `exit/` prefixes in one etcd txn a few times a
second from its own thread and keeps the last good answer; `EtcdHostDiscovery` answers
Horovod from that cache. Horovod calls discovery once a second while holding its hosts
condition and has no timeout of its own (measured with plain horovodrun: a hanging discovery
script stretched a 0.6 s recovery to 27.6 s), so discovery never does I/O: it is bounded by
construction, and when etcd is unreachable it keeps returning the last known hosts instead of an
empty set (which would pause training until the elastic timeout).

Host names are node ids: the leader starts workers through the node agents, so Horovod never
resolves or SSHes to them.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from horovod.runner.elastic.discovery import HostDiscovery

from elasticyolo.agent.staging import data_ready
from elasticyolo.agent.state import SERVING_STATES
from elasticyolo.cluster.etcd import EtcdClient, EtcdError, b64, prefix_range_end
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.engines.installed import RECORD_FIELD as REFUSED_FIELD
from elasticyolo.engines.world_health import note_step
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger


def slots_of(record: dict[str, Any], max_slots: int | None) -> int:
    """Slots a node offers: its pre-warmed slots when it reports them, else its slot count."""
    # A draining node handing over (engines/drain.py) stays listed until its world has snapshotted:
    # a hosts-updated reset racing the quiesce request would otherwise remove it first.
    handing_over = record.get("state") == "DRAINING" and record.get("drain_mode") == "handover"
    if record.get("state") not in SERVING_STATES and not handing_over:
        return 0
    if not data_ready(record):  # its s3:// dataset is still being staged (agent/staging.py)
        return 0
    if record.get(REFUSED_FIELD):  # its agent does not run this engine (no Horovod there)
        return 0
    ready = record.get("ready_slots")
    slots = int(record.get("slots") or 0) if ready is None else int(ready)
    return max(0, min(slots, max_slots) if max_slots else slots)


# A node whose record vanished stays listed this long with its last record (unless the liveness
# signals say it is lost): an agent whose lease lapsed re-registers within a tick or two, and a
# record missing for one etcd poll must not cost the world a re-form. A dead agent is told apart
# by its liveness verdict, long before this matters.
RECORD_GONE_GRACE_S = 3.0


@dataclass
class Snapshot:
    """One consistent read of the nodes, the worker exit reports and rank 0's progress."""

    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    exits: dict[str, dict[str, Any]] = field(default_factory=dict)  # request id -> report
    revision: int = 0
    at: float = 0.0  # monotonic time of the read
    # `nodes` plus those whose record vanished less than RECORD_GONE_GRACE_S ago (last record)
    listed: dict[str, dict[str, Any]] = field(default_factory=dict)
    step: int | None = None  # the world's step as rank 0 last reported it
    step_changed_at: float | None = None  # monotonic time the reported step last advanced
    step_period_s: float | None = None  # recent time between observed advances


@dataclass
class Remembered:
    """What `ClusterView` carries from one read to the next (pure updates below)."""

    last_seen: dict[str, dict[str, Any]] = field(default_factory=dict)  # node -> its last record
    missing_since: dict[str, float] = field(default_factory=dict)  # node -> the first read without it
    step: int | None = None
    step_changed_at: float | None = None
    step_period_s: float | None = None


def list_recent(nodes: dict[str, dict[str, Any]], memory: Remembered, now: float,
                grace_s: float = RECORD_GONE_GRACE_S) -> dict[str, dict[str, Any]]:
    """The nodes present plus those first read missing less than `grace_s` ago (updates
    `memory`). The grace runs from the first read without the record, not from the last one with
    it: a reader that was itself paused (the leader's agent starved) must not drop every node
    whose lease renewal fell into its pause."""
    for node, rec in nodes.items():
        memory.last_seen[node] = rec
        memory.missing_since.pop(node, None)
    listed = dict(nodes)
    for node, rec in list(memory.last_seen.items()):
        if node in nodes:
            continue
        since = memory.missing_since.setdefault(node, now)
        if now - since < grace_s:
            listed[node] = rec
        else:
            del memory.last_seen[node]
            del memory.missing_since[node]
    return listed


class ClusterView:
    """Polls etcd (every `period` s) in a daemon thread; waiters are woken after every read."""

    def __init__(self, client: EtcdClient, keys: JobKeys, period: float = 0.2) -> None:
        self.client, self.keys, self.period = client, keys, period
        self.log = get_logger("elasticyolo.discovery", job=keys.job)
        self.snapshot = Snapshot()
        self.memory = Remembered()
        self.cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-view", daemon=True)
        self._errors = 0

    def start(self) -> "ClusterView":
        self.refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self.cond:
            self.cond.notify_all()

    def refresh(self) -> bool:
        ranges = []
        for prefix in (self.keys.nodes, self.keys.exits):
            ranges.append({"request_range": {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix))}})
        ranges.append({"request_range": {"key": b64(self.keys.progress)}})
        try:
            result = self.client.txn([], ranges, [], )
        except (UnavailableError, EtcdError) as exc:
            self._errors += 1
            if self._errors in (1, 10) or self._errors % 100 == 0:
                self.log.warning("discovery cannot read etcd; keeping the last known hosts", error=str(exc))
            return False
        self._errors = 0
        snap = Snapshot(revision=int(result["header"]["revision"]), at=time.monotonic())
        responses = result.get("responses") or [{}, {}, {}]
        for i, target in enumerate((snap.nodes, snap.exits)):
            for kv in responses[i].get("response_range", {}).get("kvs") or []:
                key = _unb64(kv["key"]).decode()
                try:
                    target[key.rsplit("/", 1)[-1]] = json.loads(_unb64(kv.get("value")))
                except ValueError:
                    continue
        snap.listed = list_recent(snap.nodes, self.memory, snap.at)
        note_step(_step_of(responses[2] if len(responses) > 2 else {}), self.memory, snap.at)
        snap.step, snap.step_changed_at = self.memory.step, self.memory.step_changed_at
        snap.step_period_s = self.memory.step_period_s
        with self.cond:
            self.snapshot = snap
            self.cond.notify_all()
        return True

    def wait(self, predicate: Callable[[Snapshot], Any], timeout: float) -> Any:
        """Block until `predicate(snapshot)` is truthy (re-checked after every poll) or timeout."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                value = predicate(self.snapshot)
                left = deadline - time.monotonic()
                if value or left <= 0 or self._stop.is_set():
                    return value
                self.cond.wait(min(left, 1.0))

    def poke(self) -> None:
        """Re-check the waiters now (something outside etcd changed: a node was lost)."""
        with self.cond:
            self.cond.notify_all()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.refresh()


class EtcdHostDiscovery(HostDiscovery):
    """Live, non-draining nodes and their (ready) slots, from the `ClusterView` cache."""

    def __init__(self, view: ClusterView, max_slots_per_node: int | None = None,
                 exclude: Callable[[], set[str]] | None = None) -> None:
        super().__init__()
        self.view = view
        self.max_slots = max_slots_per_node
        self.exclude = exclude  # nodes the liveness signals say are lost (cluster/liveness.py)

    def find_available_hosts_and_slots(self) -> dict[str, int]:
        # A fresh dict every call: Horovod keeps the previous one to diff against.
        out: dict[str, int] = {}
        lost = self.exclude() if self.exclude is not None else set()
        for node_id, rec in sorted(self.view.snapshot.listed.items()):
            if node_id in lost:
                continue
            n = slots_of(rec, self.max_slots)
            if n > 0:
                out[node_id] = n
        return out


def _step_of(response: dict[str, Any]) -> int | None:
    for kv in response.get("response_range", {}).get("kvs") or []:
        try:
            return int(json.loads(_unb64(kv.get("value"))).get("step"))
        except (ValueError, TypeError, AttributeError):
            return None
    return None


def _unb64(s: str | None) -> bytes:
    import base64

    return base64.b64decode(s) if s else b""
