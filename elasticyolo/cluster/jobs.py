"""Job spec and job state records in etcd (`spec`, `state`): submit and cancel."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from elasticyolo.cluster.etcd import EtcdClient, b64
from elasticyolo.cluster.keys import JOB_SUBMITTED, JobKeys

if TYPE_CHECKING:
    from elasticyolo.spec import TrainSpec


def submit_spec(client: EtcdClient, keys: JobKeys, spec: TrainSpec, by: str, replace: bool = False) -> bool:
    """Store spec + state=submitted in one txn. Without `replace` only when no spec is stored.
    Returns False when a spec was already there (and not replaced)."""
    state = json.dumps({"state": JOB_SUBMITTED, "at": time.time(), "by": by})
    puts = [{"request_put": {"key": b64(keys.spec), "value": b64(spec.to_json())}},
            {"request_put": {"key": b64(keys.state), "value": b64(state)}}]
    compare = [] if replace else [{"key": b64(keys.spec), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}]
    return bool(client.txn(compare, puts, [])["succeeded"])
