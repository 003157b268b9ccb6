"""Leader election on one key, `/elasticyolo/<job>/leader`, with a fencing token.

* The leader key is created (create-only txn) under the candidate's *node lease*: when the
  leader dies its node record and its leader key expire together; when it leaves it revokes
  the lease and both go at once.
* The key is written once per term, so its mod revision is the term's **fencing token**.
  Writes on behalf of the leader (`fenced_put`) compare it, so a deposed leader's late writes fail.
* The same txn that takes or gives up the key also flips `leader` in the node's record, so at
  every etcd revision at most one node record says `leader: true` and it matches the key.
* Preference: a preemptible node campaigns only when no non-preemptible node is registered;
  a preemptible leader hands over (resigns) when a non-preemptible node appears, unless
  `handover=False`. Only non-preemptible nodes then compete, so this cannot flap.
* A leader also steps down locally when its lease may have expired (no keepalive within TTL),
  before etcd could hand the key to someone else.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from elasticyolo.cluster.etcd import EtcdClient, LeaseNotFoundError, b64
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.registry import NodeRecord, NodeRegistration
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.election")


@dataclass(frozen=True)
class LeaderInfo:
    node_id: str
    term: int  # fencing token: mod revision of the leader key
    since: float
    preemptible: bool
    addr: str = ""
    liveness: str = ""  # host:port of the leader's liveness server (cluster/liveness.py), if any

    @classmethod
    def from_kv(cls, value: bytes, mod_revision: int) -> "LeaderInfo":
        data = json.loads(value)
        return cls(node_id=str(data.get("node_id", "?")), term=mod_revision, since=float(data.get("since", 0)),
                   preemptible=bool(data.get("preemptible", True)), addr=str(data.get("addr", "")),
                   liveness=str(data.get("liveness") or ""))


def read_leader(client: EtcdClient, keys: JobKeys) -> LeaderInfo | None:
    got = client.get(keys.leader)
    if got is None:
        return None
    try:
        return LeaderInfo.from_kv(*got)
    except (ValueError, TypeError):
        return None


class LeaderElection:
    """Called once per agent loop iteration (`step`); it never blocks longer than one etcd call."""

    def __init__(self, client: EtcdClient, keys: JobKeys, registration: NodeRegistration,
                 handover: bool = True, reclaim_grace_s: float = 0.0,
                 leader_reachable: Callable[[LeaderInfo], bool] = lambda _leader: False) -> None:
        """`reclaim_grace_s` and `leader_reachable`: see `defers_to_previous_leader`."""
        self.client = client
        self.keys = keys
        self.reg = registration
        self.handover = handover
        self.term = 0  # >0 while we lead
        self.leader: LeaderInfo | None = None  # last seen leader (us or another node)
        self.reclaim_grace_s = reclaim_grace_s
        self.leader_reachable = leader_reachable
        self._key_gone_since: float | None = None  # monotonic: when the leader key was first seen missing

    @property
    def is_leader(self) -> bool:
        return self.term > 0

    @property
    def node_id(self) -> str:
        return self.reg.record.node_id

    def step(self, nodes: Sequence[NodeRecord] | Callable[[], Sequence[NodeRecord]]) -> bool:
        """Reconcile with etcd: keep, lose, hand over or take leadership. Returns is_leader.

        `nodes` (the registered nodes, or a function returning them) is consulted only by a
        preemptible node that must decide whether to defer; a follower that sees a leader
        never reads the node list, so big clusters do not pay O(nodes) per agent per tick."""
        if self.is_leader:
            self._check_still_leader(nodes)
        if not self.is_leader and self.reg.lease_valid():
            self._campaign(nodes)
        return self.is_leader

    def _eligible(self, nodes: Sequence[NodeRecord] | Callable[[], Sequence[NodeRecord]]) -> bool:
        if not self.reg.record.preemptible:
            return True
        listed = nodes() if callable(nodes) else nodes
        # Prefer a stable home for the elastic driver: stay out while a non-preemptible node exists.
        return not any(not n.preemptible and n.node_id != self.node_id for n in listed)

    def _check_still_leader(self, nodes: Sequence[NodeRecord] | Callable[[], Sequence[NodeRecord]]) -> None:
        if not self.reg.lease_valid():
            self._lost("lease may have expired")
            return
        got = self.client.get(self.keys.leader)
        if got is None or got[1] != self.term:
            self._lost("leader key changed")
            return
        if self.handover and self.reg.record.preemptible and not self._eligible(nodes):
            self.resign("a non-preemptible node joined")

    def _campaign(self, nodes: Sequence[NodeRecord] | Callable[[], Sequence[NodeRecord]]) -> None:
        got = self.client.get(self.keys.leader)
        if got is None:
            now = time.monotonic()
            self._key_gone_since = self._key_gone_since or now
            previous = self.leader
            if defers_to_previous_leader(previous is not None and previous.node_id != self.node_id,
                                         now - self._key_gone_since, self.reclaim_grace_s,
                                         previous is not None and self.leader_reachable(previous)):
                return
        else:
            self._key_gone_since = None
        if got is not None:
            try:
                self.leader = LeaderInfo.from_kv(*got)
                lease = int(json.loads(got[0]).get("lease", 0))
            except (ValueError, TypeError):
                self.leader, lease = None, 0
            if self.leader and self.leader.node_id == self.node_id and lease == self.reg.lease_id:
                # We stepped down locally (keepalive trouble) but etcd kept our term: resume it.
                self.term = self.leader.term
                self.reg.update(leader=True)
                log.info("resumed leadership", node=self.node_id, term=self.term)
            return
        if not self._eligible(nodes):
            return
        rec = self.reg.record
        value = json.dumps({"node_id": rec.node_id, "addr": rec.addr, "host": rec.host,
                            "preemptible": rec.preemptible, "since": time.time(), "lease": self.reg.lease_id,
                            "liveness": rec.extra.get("liveness")})
        with self.reg._write_lock:  # the node record must not be rewritten between our read and txn
            rec_json = _with_leader(rec, True)
            lease = str(self.reg.lease_id)
            try:
                result = self.client.txn(
                    [{"key": b64(self.keys.leader), "result": "EQUAL", "target": "CREATE", "create_revision": "0"},
                     # our record must still exist (under our lease): a lost node never leads
                     {"key": b64(self.reg.key), "result": "GREATER", "target": "VERSION", "version": "0"}],
                    [{"request_put": {"key": b64(self.keys.leader), "value": b64(value), "lease": lease}},
                     {"request_put": {"key": b64(self.reg.key), "value": b64(rec_json), "lease": lease}}],
                    [],
                )
            except LeaseNotFoundError:
                return
            if not result["succeeded"]:
                return
            rec.leader = True
            self.term = int(result["header"]["revision"])
            self.reg.mod_revision = self.term
        self.leader = LeaderInfo(rec.node_id, self.term, time.time(), rec.preemptible, rec.addr,
                                 str(rec.extra.get("liveness") or ""))
        log.info("became leader", node=rec.node_id, term=self.term)

    def resign(self, reason: str) -> None:
        """Give up leadership: delete the key (only if still ours) and clear our record's flag."""
        if not self.is_leader:
            return
        rec = self.reg.record
        term = self.term
        with self.reg._write_lock:
            try:
                self.client.txn(
                    [{"key": b64(self.keys.leader), "result": "EQUAL", "target": "MOD", "mod_revision": str(term)}],
                    [{"request_delete_range": {"key": b64(self.keys.leader)}},
                     {"request_put": {"key": b64(self.reg.key), "value": b64(_with_leader(rec, False)),
                                      "lease": str(self.reg.lease_id)}}],
                    [],
                )
            except LeaseNotFoundError:
                pass
            rec.leader = False
        self.term = 0
        self.leader = None
        log.info("resigned leadership", node=rec.node_id, term=term, reason=reason)

    def _lost(self, reason: str) -> None:
        term = self.term
        self.term = 0
        self.reg.record.leader = False
        log.warning("lost leadership", node=self.node_id, term=term, reason=reason)
        if not self.reg.lease_valid():
            return  # the flag goes with the lease, as the key does (no write that may hang: cut off)
        try:
            self.reg.update(leader=False)
        except Exception as exc:  # noqa: BLE001 - the next loop iteration rewrites the record
            log.warning("could not clear leader flag", error=str(exc))

    def fenced_txn_compare(self) -> dict[str, Any]:
        """A txn compare that holds only while our term is current (prepend to leader writes)."""
        return {"key": b64(self.keys.leader), "result": "EQUAL", "target": "MOD", "mod_revision": str(self.term)}

    def fenced_put(self, key: str, value: bytes | str, lease: int | None = None) -> bool:
        """Write `key` only if we still lead this term. False: deposed (the write did not happen)."""
        if not self.is_leader:
            return False
        put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
        if lease:
            put["lease"] = str(lease)
        return bool(self.client.txn([self.fenced_txn_compare()], [{"request_put": put}], [])["succeeded"])


def defers_to_previous_leader(previous_is_other: bool, key_gone_s: float, grace_s: float, reachable: bool) -> bool:
    """Whether a follower holds back its campaign when the leader key is gone: for `grace_s` while
    the previous leader's agent still looks alive (its liveness connection is open). A leader whose
    lease lapsed under load re-registers and takes its lead back, and its driver keeps the running
    world (engines/horovod/node.py). A leader that died closed that connection: no wait then."""
    return previous_is_other and reachable and key_gone_s < grace_s


def _with_leader(rec: NodeRecord, leader: bool) -> str:
    saved = rec.leader, rec.updated_at
    rec.leader, rec.updated_at = leader, time.time()
    try:
        return rec.to_json()
    finally:
        rec.leader, rec.updated_at = saved
