"""This node's billing record: what it costs and until when it was seen, kept after it is gone.

A node's record under `nodes/` lives on its lease, so a preempted or killed node's spend would
vanish from `status` with it. Each agent therefore also keeps an unleased record
(`JobKeys.billing_entry`) with its prices, when it started, and when it was last seen alive,
refreshed every `interval_s` and at a clean exit. `cost.job_cost` bills a departed node from
`started_at` to `last_seen`: at most `interval_s` short of when it vanished, never more.
"""

from __future__ import annotations

import json
import time
from typing import Any

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.registry import NodeRecord

REFRESH_S = 10.0


def billing_record(record: NodeRecord, last_seen: float, ended: bool) -> dict[str, Any]:
    return {"node_id": record.node_id, "started_at": record.started_at, "last_seen": round(last_seen, 3),
            "ended": ended, "price_per_hour": record.price_per_hour,
            "on_demand_per_hour": record.extra.get("on_demand_per_hour"), "slots": record.slots}


class BillingLedger:
    def __init__(self, client: EtcdClient, keys: JobKeys, record: NodeRecord, interval_s: float = REFRESH_S) -> None:
        self.client, self.keys, self.record, self.interval_s = client, keys, record, interval_s
        self._written_at = 0.0  # monotonic

    @property
    def priced(self) -> bool:
        return self.record.price_per_hour is not None

    def due(self, now_mono: float) -> bool:
        return self.priced and now_mono - self._written_at >= self.interval_s

    def write(self, ended: bool = False) -> None:
        """Raises the client's errors (the caller's loop logs and retries them)."""
        if not self.priced:
            return
        key = self.keys.billing_entry(self.record.node_id, self.record.started_at)
        self.client.put(key, json.dumps(billing_record(self.record, time.time(), ended)))
        self._written_at = time.monotonic()
