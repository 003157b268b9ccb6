"""Job spec and job state records in etcd (`spec`, `state`): submit, and state changes fenced by
the submission they are about. Every write of the `state` record goes through here, and every
state it writes is the outcome of the one transition rule (`cluster/job_state.py`)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Sequence

from elasticyolo.cluster.etcd import EtcdClient, b64
from elasticyolo.cluster.job_state import JobEvent, JobState, Refused, next_job_state
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.errors import UserError

if TYPE_CHECKING:
    from elasticyolo.spec import TrainSpec


def submit_spec(client: EtcdClient, keys: JobKeys, spec: TrainSpec, by: str, replace: bool = False) -> bool:
    """Store spec + state=submitted in one txn. Without `replace` only when no spec is stored.
    Returns False when a spec was already there (and not replaced)."""
    current, _revision = read_job_state(client, keys)
    state = next_job_state(current, JobEvent.SUBMIT)
    if isinstance(state, Refused):
        raise UserError(f"job {keys.job!r} cannot be submitted: {state.reason}")
    puts = [{"request_put": {"key": b64(keys.spec), "value": b64(spec.to_json())}},
            {"request_put": {"key": b64(keys.state), "value": b64(_record(state, by, None))}}]
    compare = [] if replace else [{"key": b64(keys.spec), "result": "EQUAL", "target": "CREATE", "create_revision": "0"}]
    return bool(client.txn(compare, puts, [])["succeeded"])


def set_job_state(client: EtcdClient, keys: JobKeys, event: JobEvent, *, by: str, generation: int | None = None,
                  reason: str | None = None, fence: Sequence[dict[str, Any]] = ()) -> bool:
    """Apply `event` to the stored job state (`next_job_state`) and write the outcome in one txn,
    only while the state record is still the one read, the spec is still submission `generation`
    (its mod revision; None: any submission) and every `fence` compare holds (e.g. the leader's
    term, `LeaderElection.fenced_txn_compare`). Returns whether it was written (False: the rule
    refuses the event in the current state, or another node or the operator got there first)."""
    current, revision = read_job_state(client, keys)
    state = next_job_state(current, event)
    if isinstance(state, Refused):
        return False
    compare = [{"key": b64(keys.state), "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)},
               *fence]
    if generation is not None:
        compare.insert(0, {"key": b64(keys.spec), "result": "EQUAL", "target": "MOD",
                           "mod_revision": str(generation)})
    result = client.txn(compare, [{"request_put": {"key": b64(keys.state), "value": b64(_record(state, by, reason))}}],
                        [])
    return bool(result.get("succeeded"))


def read_job_state(client: EtcdClient, keys: JobKeys) -> tuple[JobState | None, int]:
    """The stored job state and its record's mod revision (0: no record, which counts as
    submitted); None as the state when the record is unreadable."""
    got = client.get(keys.state)
    if got is None:
        return JobState.SUBMITTED, 0
    return _state_of(got[0]), got[1]


def _record(state: JobState, by: str, reason: str | None) -> str:
    rec: dict[str, Any] = {"state": state.value, "at": time.time(), "by": by}
    if reason:
        rec["reason"] = reason
    return json.dumps(rec)


def _state_of(raw: bytes) -> JobState | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return JobState.parse(value.get("state")) if isinstance(value, dict) else None
