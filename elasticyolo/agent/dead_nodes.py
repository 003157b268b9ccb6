"""The leader ends a dead agent's registration at once instead of waiting out its lease.

When an agent process dies, the kernel closes its liveness connection and the leader's server
says DEAD within milliseconds (`cluster/liveness.py`). The lease stays the authority on
membership: the leader revokes the dead node's lease, which is what its expiry would do `ttl`
seconds later, so everything that follows membership sees the loss now (the torch rendezvous,
`engines/torch/membership.py`; `elasticyolo status`; Horovod's discovery). Only a lease whose
record carries the dead connection's token is revoked: that connection spoke for that
registration (a restarted agent has a new token). A wrongly revoked agent (it was alive after
all) finds its lease gone and registers again, as after any lease loss.

SUSPECT (no heartbeat) never revokes: a frozen or starved agent may come back, and its workers
may still be training (the Horovod driver handles suspects without blacklisting anyone).
"""

from __future__ import annotations

import json
import queue
import threading
from typing import Callable

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.liveness import LivenessServer, Verdict
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.dead_nodes")


def lease_to_revoke(verdict: Verdict, conn_token: str | None, record: dict[str, object] | None,
                    lease: int, leader: bool) -> int | None:
    """The lease to revoke for a verdict, or None (pure)."""
    if verdict is not Verdict.DEAD or not leader or record is None or not lease or not conn_token:
        return None
    return lease if str(record.get("liveness_token") or "") == conn_token else None


class DeadNodeReaper:
    """Listens to the leader's liveness verdicts; revokes on its own thread (never blocks the
    liveness server's selector loop)."""

    def __init__(self, client: EtcdClient, keys: JobKeys, liveness: LivenessServer,
                 is_leader: Callable[[], bool]) -> None:
        self.client, self.keys, self.liveness, self.is_leader = client, keys, liveness, is_leader
        self._queue: queue.Queue[tuple[str, str | None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="dead-nodes", daemon=True)

    def start(self) -> "DeadNodeReaper":
        self.liveness.add_listener(self._on_verdicts)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.liveness.remove_listener(self._on_verdicts)
        self._queue.put(None)
        self._thread.join(2)

    def _on_verdicts(self, diff: dict[str, Verdict]) -> None:
        for node, v in diff.items():
            if v is Verdict.DEAD:
                self._queue.put((node, self.liveness.token_of(node)))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            node, token = item
            try:
                self.reap(node, token)
            except Exception as exc:  # noqa: BLE001 - the lease expires on its own anyway
                log.warning("could not end a dead node's registration; its lease will", node=node, error=str(exc))

    def reap(self, node: str, token: str | None) -> bool:
        key = self.keys.node(node)
        kvs, _ = self.client.get_prefix_kvs(key)
        kv = next((kv for kv in kvs if kv.key == key), None)
        record = json.loads(kv.value) if kv is not None else None
        lease = lease_to_revoke(Verdict.DEAD, token, record, kv.lease if kv else 0, self.is_leader())
        if lease is None:
            return False
        revoked = self.client.lease_revoke(lease)
        log.info("dead node's lease revoked (its agent's connection closed)", node=node, revoked=revoked)
        return revoked
