"""The leader turns its liveness verdicts into etcd facts, ahead of the leases.

* **DEAD** (the agent's connection closed without `bye`, `cluster/liveness.py`): the agent process
  is gone. The lease stays the authority on membership: the leader revokes the dead node's lease,
  which is what its expiry would do `ttl` seconds later, so everything that follows membership
  sees the loss now (the torch rendezvous, `engines/torch/membership.py`; `elasticyolo status`;
  Horovod's discovery). A wrongly revoked agent (it was alive after all) finds its lease gone and
  registers again, as after any lease loss.
* **SUSPECT** (no heartbeat for the timeout: a frozen VM, a network cut) never revokes: the node
  may come back, and its workers may still be training. The leader publishes `suspects/<node>`
  instead (under its own lease, fenced by its term): the torch rendezvous leaves a suspect out of
  its rounds at the heartbeat timeout rather than at the lease's expiry (2 s instead of 5 s by
  default), and `status` shows it. The key goes when the node beats again, dies, or the leader
  stops leading (with its lease, if it dies). The Horovod driver reads the verdicts in process.

Only a verdict on a connection that carries the node record's `liveness_token` counts (that
connection spoke for that registration; a restarted agent has a new token, and a process that
can reach the port but not etcd cannot make the leader drop a node by claiming its name).
Which keys to write is pure (`lease_to_revoke`, `suspect_writes`); `VerdictPublisher` applies it
on its own thread and re-tries failed writes every `RECONCILE_S`.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from typing import Any, Callable

from elasticyolo.cluster.etcd import EtcdClient, b64
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.liveness import LivenessServer, Verdict
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.dead_nodes")

RECONCILE_S = 1.0  # a failed suspect write (etcd hiccup) is re-tried this often


def speaks_for(conn_token: str | None, record: dict[str, object] | None) -> bool:
    """Whether the connection (its hello's token) spoke for the node's current registration."""
    return bool(conn_token) and record is not None and str(record.get("liveness_token") or "") == conn_token


def lease_to_revoke(verdict: Verdict, conn_token: str | None, record: dict[str, object] | None,
                    lease: int, leader: bool) -> int | None:
    """The lease to revoke for a verdict, or None (pure)."""
    if verdict is not Verdict.DEAD or not leader or not lease or not speaks_for(conn_token, record):
        return None
    return lease


def suspect_writes(wanted: set[str], published: set[str], leader: bool) -> tuple[set[str], set[str]]:
    """(suspect keys to put, suspect keys to delete) (pure). Only a leader publishes; one that
    no longer leads takes back what it published."""
    if not leader:
        return set(), set(published)
    return wanted - published, published - wanted


class VerdictPublisher:
    """Listens to the leader's liveness verdicts; writes etcd on its own thread (never blocks the
    liveness server's selector loop)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, liveness: LivenessServer,
                 is_leader: Callable[[], bool], *, fence: Callable[[], dict[str, Any]] | None = None,
                 lease: Callable[[], int] = lambda: 0, node_id: str = "") -> None:
        self.client, self.keys, self.liveness, self.is_leader = client, keys, liveness, is_leader
        self.fence, self.lease, self.node_id = fence, lease, node_id
        self.suspects: set[str] = set()  # suspects with the record's token (the wanted keys)
        self.published: set[str] = set()  # suspect keys this agent has written and not deleted
        self._queue: queue.Queue[tuple[str, Verdict, str | None] | tuple[()] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="liveness-verdicts", daemon=True)

    def start(self) -> "VerdictPublisher":
        self.liveness.add_listener(self._on_verdicts)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.liveness.remove_listener(self._on_verdicts)
        self._queue.put(None)
        self._thread.join(2)

    def _on_verdicts(self, diff: dict[str, Verdict]) -> None:
        for node, v in diff.items():
            self._queue.put((node, v, self.liveness.token_of(node)))

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=RECONCILE_S)
            except queue.Empty:
                item = ()  # a tick: re-try what failed
            if item is None:
                break
            try:
                if item:
                    self._on_verdict(*item)
                self.reconcile()
            except Exception as exc:  # noqa: BLE001 - the lease decides on its own anyway
                log.warning("could not publish a liveness verdict; retrying", error=str(exc))

    def _on_verdict(self, node: str, verdict: Verdict, token: str | None) -> None:
        if verdict is Verdict.DEAD:
            self.suspects.discard(node)
            self.reap(node, token)
        elif verdict is Verdict.SUSPECT:
            if self.is_leader() and speaks_for(token, self._record(node)[0]):
                self.suspects.add(node)
        else:
            self.suspects.discard(node)

    def _record(self, node: str) -> tuple[dict[str, Any] | None, int]:
        key = self.keys.node(node)
        kvs, _ = self.client.get_prefix_kvs(key)
        kv = next((kv for kv in kvs if kv.key == key), None)
        return (json.loads(kv.value), kv.lease) if kv is not None else (None, 0)

    def reap(self, node: str, token: str | None) -> bool:
        record, lease_id = self._record(node)
        lease = lease_to_revoke(Verdict.DEAD, token, record, lease_id, self.is_leader())
        if lease is None:
            return False
        revoked = self.client.lease_revoke(lease)
        log.info("dead node's lease revoked (its agent's connection closed)", node=node, revoked=revoked)
        return revoked

    def reconcile(self) -> None:
        """Make the suspect keys in etcd what the verdicts say (each write is retried next tick)."""
        leader = self.is_leader() and self.fence is not None
        put, delete = suspect_writes(self.suspects, self.published, leader)
        lease = self.lease()
        for node in sorted(put):
            value = json.dumps({"node": node, "by": self.node_id, "at": time.time()})
            request: dict[str, Any] = {"key": b64(self.keys.suspect(node)), "value": b64(value)}
            if lease:
                request["lease"] = str(lease)
            assert self.fence is not None
            if self.client.txn([self.fence()], [{"request_put": request}], [])["succeeded"]:
                self.published.add(node)
                log.info("node suspected: left out of rendezvous rounds until it beats again", node=node)
        for node in sorted(delete):
            key = self.keys.suspect(node)
            if lease:  # only our own key: a newer leader may have written it since
                self.client.txn([{"key": b64(key), "result": "EQUAL", "target": "LEASE", "lease": str(lease)}],
                                [{"request_delete_range": {"key": b64(key)}}], [])
            else:
                self.client.delete(key)
            self.published.discard(node)
            log.info("node no longer suspected", node=node)
