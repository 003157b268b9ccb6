"""Node registry: `/elasticyolo/<job>/nodes/<node-id>` under a lease kept alive by a thread.

A node whose agent dies disappears when its lease expires (TTL). A node that leaves cleanly
revokes its lease, so its record (and its leader key, which shares the lease) go at once.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable

from elasticyolo.cluster.etcd import EtcdClient, EtcdError, LeaseNotFoundError
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.registry")


@dataclass
class NodeRecord:
    """What a node tells the cluster about itself (JSON at nodes/<node-id>).

    Unknown fields in stored records are kept in `extra`, so older agents and status views
    read records written by newer agents.
    """

    node_id: str
    host: str
    addr: str
    slots: int
    state: str = "JOINING"
    preemptible: bool = True
    instance_type: str | None = None
    zone: str | None = None
    price_per_hour: float | None = None
    agent_version: str = ""
    started_at: float = 0.0  # unix seconds
    pid: int = 0
    leader: bool = False
    notice: dict[str, Any] | None = None  # interruption notice: {"action", "time", "source"}
    ranks: list[int] = field(default_factory=list)
    updated_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        data = asdict(self)
        extra = data.pop("extra")
        return json.dumps({**extra, **data}, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> "NodeRecord":
        data = json.loads(raw)
        known = {f.name for f in fields(cls)} - {"extra"}
        values = {k: v for k, v in data.items() if k in known}
        values["extra"] = {k: v for k, v in data.items() if k not in known}
        return cls(**values)


class NodeIdTakenError(Exception):
    """Another live agent holds nodes/<node-id>."""


class NodeRegistration:
    """Registers one node and keeps its lease alive.

    `lease_valid()` is the local, conservative view of whether the lease still exists: it is
    false from (send time of the last successful keepalive + TTL) on. The leader checks it so it
    never believes it leads after etcd could have expired its lease.
    """

    def __init__(self, client: EtcdClient, keys: JobKeys, record: NodeRecord, ttl: int,
                 on_lease_lost: Callable[[], None] | None = None,
                 on_renew: Callable[[float | None], None] | None = None,
                 keepalive_client: EtcdClient | None = None) -> None:
        self.client = client
        # Keepalives on a connection of their own: a slow request of the agent (a big txn, a
        # loaded etcd) must not hold up the renewal that keeps the node alive.
        self.keepalive_client = keepalive_client or client
        self.keys = keys
        self.record = record
        self.ttl = int(ttl)
        self.lease_id = 0
        self.mod_revision = 0
        self._valid_until = 0.0
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._write_lock = threading.Lock()
        self._on_lease_lost = on_lease_lost
        self._on_renew = on_renew  # latency in seconds, or None for a failed renewal

    @property
    def key(self) -> str:
        return self.keys.node(self.record.node_id)

    # ---- lifecycle ----------------------------------------------------------------------
    def register(self) -> None:
        """Grant a lease and create the node key (create-only: a live duplicate id is refused)."""
        sent = time.monotonic()
        lease = self.client.lease_grant(self.ttl)
        self.record.updated_at = time.time()
        ok, current = self.client.compare_and_swap(self.key, self.record.to_json(), 0, lease=lease)
        if not ok:
            self.client.lease_revoke(lease)
            holder = "?"
            if current is not None:
                try:
                    other = NodeRecord.from_json(current[0])
                    holder = f"host {other.host} pid {other.pid}"
                except (ValueError, TypeError):
                    pass
            raise NodeIdTakenError(f"node id {self.record.node_id!r} is already registered by {holder}")
        self.lease_id = lease
        self.mod_revision = current[1] if current else 0
        self._valid_until = sent + self.ttl
        self._lost.clear()

    def start_keepalive(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._keepalive_loop, name="lease-keepalive", daemon=True)
        self._thread.start()

    def stop_keepalive(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.ttl + 1)
            self._thread = None

    def leave(self) -> bool:
        """Stop renewing and revoke the lease: the node key (and a leader key) vanish at once."""
        self.stop_keepalive()
        if not self.lease_id:
            return False
        revoked = self.client.lease_revoke(self.lease_id)
        self.lease_id = 0
        self._valid_until = 0.0
        return revoked

    # ---- state --------------------------------------------------------------------------
    def lease_valid(self) -> bool:
        return bool(self.lease_id) and not self._lost.is_set() and time.monotonic() < self._valid_until

    def lease_lost(self) -> bool:
        return self._lost.is_set()

    def seconds_left(self) -> float:
        return max(0.0, self._valid_until - time.monotonic())

    def update(self, **changes: Any) -> None:
        """Rewrite the record with changes (state, notice, ranks, ...) under the same lease."""
        with self._write_lock:
            for name, value in changes.items():
                setattr(self.record, name, value)
            self.record.updated_at = time.time()
            if not self.lease_id or self._lost.is_set():
                return  # written on the next registration
            try:
                self.mod_revision = self.client.put(self.key, self.record.to_json(), lease=self.lease_id)
            except LeaseNotFoundError:
                self._mark_lost()

    # ---- keepalive ----------------------------------------------------------------------
    def _keepalive_loop(self) -> None:
        # Renew three times per TTL. Each request is bounded well under the TTL (one slow member
        # cannot starve the lease: the next try goes to the next endpoint), but retries go on for
        # as long as the lease still has: a loaded etcd answering late is no reason to lose it.
        interval = max(self.ttl / 3.0, 0.2)
        per_try = max(self.ttl / 4.0, 0.3)
        next_at = time.monotonic() + interval
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            lease = self.lease_id
            if not lease or self._lost.is_set():
                next_at = time.monotonic() + interval
                continue
            sent = time.monotonic()
            try:
                window = max(per_try, self.seconds_left() - 0.05)
                self.keepalive_client.lease_refresh(lease, timeout=per_try, retry_window=window)
            except LeaseNotFoundError:
                self._mark_lost()
                next_at = time.monotonic() + interval
                continue
            except (UnavailableError, EtcdError) as exc:
                if self._on_renew:
                    self._on_renew(None)
                log.warning("lease renewal failed; retrying", lease=f"{lease:x}", error=str(exc),
                            seconds_left=round(self.seconds_left(), 2))
                next_at = time.monotonic() + min(0.25, interval)
                continue
            if lease == self.lease_id:
                self._valid_until = sent + self.ttl
            if self._on_renew:
                self._on_renew(time.monotonic() - sent)
            next_at = sent + interval

    def _mark_lost(self) -> None:
        if not self._lost.is_set():
            self._lost.set()
            log.warning("lease lost", lease=f"{self.lease_id:x}", node=self.record.node_id)
            if self._on_lease_lost:
                self._on_lease_lost()


def read_nodes(client: EtcdClient, keys: JobKeys) -> list[tuple[NodeRecord, int]]:
    """Every registered node with its lease id, sorted by node id. Corrupt records are skipped."""
    kvs, _ = client.get_prefix_kvs(keys.nodes)
    out: list[tuple[NodeRecord, int]] = []
    for kv in kvs:
        try:
            out.append((NodeRecord.from_json(kv.value), kv.lease))
        except (ValueError, TypeError):
            continue
    return out
