"""Job spec and job state records in etcd (`spec`, `state`): submit, and state changes fenced by
the submission they are about."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Sequence

from elasticyolo.cluster.etcd import EtcdClient, b64
from elasticyolo.cluster.keys import ACTIVE_JOB_STATES, JOB_SUBMITTED, JobKeys

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


def set_job_state(client: EtcdClient, keys: JobKeys, state: str, *, generation: int, by: str,
                  only_from: Sequence[str] = ACTIVE_JOB_STATES, reason: str | None = None,
                  fence: Sequence[dict[str, Any]] = ()) -> bool:
    """Write the job state `state` in one txn, only while the spec is still submission
    `generation` (its mod revision) and the current state is one of `only_from`. Returns whether
    it was written (False: another node or the operator got there first, or nothing changed).
    `fence`: more txn compares, e.g. the leader's term (`LeaderElection.fenced_txn_compare`)."""
    got = client.get(keys.state)
    current = _state_of(got[0]) if got is not None else JOB_SUBMITTED
    if current not in only_from or current == state:
        return False
    rec: dict[str, Any] = {"state": state, "at": time.time(), "by": by}
    if reason:
        rec["reason"] = reason
    compare = [{"key": b64(keys.spec), "result": "EQUAL", "target": "MOD", "mod_revision": str(generation)},
               {"key": b64(keys.state), "result": "EQUAL", "target": "MOD", "mod_revision": str(got[1] if got else 0)},
               *fence]
    result = client.txn(compare, [{"request_put": {"key": b64(keys.state), "value": b64(json.dumps(rec))}}], [])
    return bool(result.get("succeeded"))


def _state_of(raw: bytes) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return str(value.get("state")) if isinstance(value, dict) else None
