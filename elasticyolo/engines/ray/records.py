"""A Ray job's records, in Ray's GCS key-value store (namespace `elasticyolo`), under the same key
names as an agents' job in etcd (`cluster/keys.py`): the spec, the job state, the world (the
controller's), rank 0's progress, resume and newest-checkpoint records (`worker_runtime/
progress.py`'s `EtcdProgress`, which needs only `put`), and the Ray engine's own two: the nodes
the job holds and its recent events. `collect` reads them into the dict `elasticyolo status`
shows for the other engines (`status.py`), so `status.render_table` and `--json` serve both.

Torch-free. Ray is imported on first use (the caller is connected to the cluster).
"""

from __future__ import annotations

import json
import time
from typing import Any

from elasticyolo import cost
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.errors import UnavailableError

NAMESPACE = "elasticyolo"
EVENTS_KEPT = 20


def nodes_key(keys: JobKeys) -> str:
    return keys.prefix + "ray/nodes"


def events_key(keys: JobKeys) -> str:
    return keys.prefix + "ray/events"


class GcsKV:
    """`put`/`get` on Ray's GCS KV. A failed `put` raises `UnavailableError` (what `EtcdProgress`
    rides out)."""

    def put(self, key: str, value: bytes | str) -> int:
        from ray.experimental import internal_kv

        try:
            internal_kv._internal_kv_put(key, value, overwrite=True, namespace=NAMESPACE)
        except Exception as exc:  # noqa: BLE001 - Ray raises several kinds for an unreachable GCS
            raise UnavailableError(f"Ray's GCS key-value store: {exc}") from exc
        return 0

    def get(self, key: str) -> bytes | None:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_get(key, namespace=NAMESPACE)

    def get_json(self, key: str) -> Any:
        raw = self.get(key)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def put_json(self, key: str, value: Any) -> None:
        self.put(key, json.dumps(value))

    def delete_prefix(self, prefix: str) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(prefix, del_by_prefix=True, namespace=NAMESPACE)


def collect(kv: GcsKV, keys: JobKeys) -> dict[str, Any]:
    """The status of a Ray job, in `status.collect`'s shape ("none" when nothing was submitted)."""
    from elasticyolo.status import _epochs_done

    def rec(key: str) -> dict[str, Any]:
        got = kv.get_json(key)
        return got if isinstance(got, dict) else {}

    spec, state_rec, world = kv.get_json(keys.spec), rec(keys.state), rec(keys.world)
    progress, checkpoint, controller = rec(keys.progress), rec(keys.checkpoint_latest), rec(keys.leader)
    held = kv.get_json(nodes_key(keys)) or []
    events = kv.get_json(events_key(keys)) or []
    resume = kv.get_json(keys.resume)
    now = time.time()
    ranks = world.get("ranks") if isinstance(world.get("ranks"), dict) else {}
    nodes = []
    for n in held if isinstance(held, list) else []:
        started = n.get("started_at")
        nodes.append({
            "id": n.get("id"), "state": n.get("state", "?"), "suspect": False, "slots": n.get("slots"),
            "ranks": ranks.get(n.get("id"), []), "leader": n.get("id") == controller.get("node_id"),
            "preemptible": None, "lease_ttl_s": None, "age_s": round(now - started, 1) if started else None,
            "notice": n.get("notice"), "price_per_hour": None, "on_demand_per_hour": None, "price_source": None,
            "started_at": started, "spent_usd": None, "host": n.get("host"), "addr": n.get("host"),
            "instance_type": None, "zone": None, "agent_version": None, "data": None, "refused": None,
            "ray_node_id": n.get("ray_node_id"),
        })
    epochs_done = _epochs_done(progress)
    job_cost = cost.job_cost(nodes, now, [])
    job_cost["usd_per_epoch"] = cost.usd_per_epoch(job_cost["spent_usd"], epochs_done)
    steady = progress.get("steady_samples_s_per_worker")
    slots = sum(int(n["slots"] or 0) for n in nodes)
    return {
        "job": keys.job, "engine": "ray",
        "state": state_rec.get("state") or ("submitted" if spec is not None else "none"),
        "reason": state_rec.get("reason"), "generation": state_rec.get("generation"), "worker_errors": [],
        "world_size": world.get("world_size", progress.get("world_size")),
        "leader": controller.get("node_id"), "leader_term": None,
        "epoch": progress.get("epoch"), "step": progress.get("step"), "samples_s": progress.get("samples_s"),
        "progress_at": progress.get("at"), "epochs_done": epochs_done, "cost": job_cost,
        "goodput": {"ratio": cost.goodput(progress.get("samples_s"), steady, slots),
                    "samples_s": progress.get("samples_s"), "steady_samples_s_per_worker": steady,
                    "paid_slots": slots},
        "at": now, "last_checkpoint": checkpoint or None, "spec": spec, "revision": None,
        "nodes": nodes, "events": events if isinstance(events, list) else [], "last_resume": resume,
        "world": {k: world.get(k) for k in ("uuid", "members", "nodes", "reason")} if world else None,
    }
