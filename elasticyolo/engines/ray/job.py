"""Start, read and stop a Ray job: the Python entry (`elasticyolo.engines.ray.submit/status/
cancel`, for a Ray driver) that `elasticyolo ray submit|status|cancel` calls. Torch-free.

`submit` connects to the cluster (`address`, or the cluster this process is in, or the driver's
connection when `ray.init` was called already), checks that enough nodes have room for the job's
slots, writes the spec to Ray's GCS KV and starts the job's controller (`controller.py`): a
detached actor named `job-<job>` in the `elasticyolo` namespace, on the head node, which then runs
the job whether or not the submitting process stays.
"""

from __future__ import annotations

import socket
import time
from typing import Any, Iterable

from elasticyolo.cluster.keys import JobKeys
from elasticyolo.engines.installed import engine_refusal
from elasticyolo.engines.ray import records
from elasticyolo.engines.ray.engine import ENGINE
from elasticyolo.errors import UserError
from elasticyolo.spec import TrainSpec
from elasticyolo.worker_runtime.worker_env import DEFAULT_WORK_ROOT

NAMESPACE = records.NAMESPACE
HEAD_RESOURCE = "node:__internal_head__"
START_TIMEOUT_S = 120.0
REACH_TIMEOUT_S = 3.0


def controller_name(job: str) -> str:
    return f"job-{job}"


def connect(address: str | None = None) -> None:
    """Connect this process to the Ray cluster (a no-op when it is connected already)."""
    refused = engine_refusal(ENGINE)
    if refused is not None:
        raise UserError(refused)
    import ray

    if ray.is_initialized():
        return
    if address and address not in ("auto", "local") and not address.startswith("ray://"):
        _check_reachable(address)
    try:
        ray.init(address=address or "auto", namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR",
                 configure_logging=False)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        where = f"at {address}" if address else "here (no --address, and this host runs no Ray node)"
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"no Ray cluster {where}: {first} (pass --address HEAD_HOST:6379, or run inside the "
                        "cluster)") from None


def _check_reachable(address: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--address {address!r}: expected HOST:PORT of the Ray head node's GCS (e.g. 10.0.0.1:6379)")
    try:
        socket.create_connection((host, int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise UserError(f"--address {address}: no Ray cluster answers there ({exc.strerror or exc}); "
                        "give the head node's GCS address (ray start --head prints it)") from None


def _controller(job: str) -> Any:
    import ray

    try:
        return ray.get_actor(controller_name(job), namespace=NAMESPACE)
    except ValueError:
        return None


def slot_bundle(spec: TrainSpec, cpus_per_slot: float, gpus_per_slot: float | None) -> dict[str, float]:
    """One slot's resources: its CPUs, and one GPU unless the spec trains on the CPU or the
    cluster has none (`gpus_per_slot` None: decide from the cluster)."""
    import ray

    if gpus_per_slot is None:
        gpus_per_slot = 1.0 if spec.device != "cpu" and ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    bundle = {"CPU": float(cpus_per_slot)}
    if gpus_per_slot:
        bundle["GPU"] = float(gpus_per_slot)
    return bundle


def nodes_with_room(bundle: dict[str, float], slots: int, nodes: Iterable[dict[str, Any]]) -> int:
    """How many alive nodes can hold `slots` bundles (by their total resources). Pure."""
    return sum(1 for n in nodes if n.get("Alive") and all(
        n.get("Resources", {}).get(k, 0.0) >= v * slots for k, v in bundle.items()))


def submit(spec: TrainSpec | Iterable[str], job: str, *, address: str | None = None,
           work_root: str = DEFAULT_WORK_ROOT, cpus_per_slot: float = 1.0, gpus_per_slot: float | None = None,
           notices: dict[str, Any] | None = None, runtime_env: dict[str, Any] | None = None,
           wait_for_nodes: bool = False) -> dict[str, Any]:
    """Start `job` on the Ray cluster. `spec`: a TrainSpec or key=value pairs (engine=ray implied).
    `notices`: the spot watcher's options on every node (`spot.make_watcher`: provider=,
    metadata_url=, notice_file= with `{node}` for the node's name, poll_interval_s=).
    `wait_for_nodes`: start even when fewer than min_nodes have room now (an autoscaling cluster).
    Returns where the controller runs."""
    if not isinstance(spec, TrainSpec):
        pairs = list(spec)
        if not any(p.startswith("engine=") for p in pairs):
            pairs.append("engine=ray")
        spec = TrainSpec.from_pairs(pairs)
    if spec.engine != "ray":
        raise UserError(f"engine={spec.engine}: a Ray job's spec says engine=ray (or names no engine)")
    if spec.resume:
        raise UserError(f"resume={spec.resume}: a cluster job resumes by itself from its checkpoint store "
                        "(checkpoint=URI; submit again with the same job name)")
    keys = JobKeys(job)  # checks the name
    connect(address)
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from elasticyolo.engines.ray.controller import JobConfig, JobController

    if _controller(job) is not None:
        raise UserError(f"job {job!r} is running on this Ray cluster already: "
                        f"`elasticyolo ray cancel --job {job}` first")
    bundle = slot_bundle(spec, cpus_per_slot, gpus_per_slot)
    nodes = ray.nodes()
    room = nodes_with_room(bundle, spec.slots, nodes)
    if room < spec.min_nodes and not wait_for_nodes:
        raise UserError(f"the Ray cluster has {room} node(s) with room for {spec.slots} slot(s) of {bundle}, and "
                        f"min_nodes={spec.min_nodes}: add nodes (`ray start --address=HEAD:6379`), lower "
                        "min_nodes, or pass --wait-for-nodes on an autoscaling cluster")
    kv = records.GcsKV()
    kv.delete_prefix(keys.prefix)  # a previous run's records of the same name
    kv.put(keys.spec, spec.to_json())
    generation = int(time.time() * 1000)
    config = JobConfig(job=job, spec_json=spec.to_json(), generation=generation, min_nodes=spec.min_nodes,
                       max_nodes=spec.max_nodes or (1 << 20), slots=spec.slots, bundle=bundle, work_root=work_root,
                       notices=dict(notices or {}), runtime_env=runtime_env)
    head = next((n["NodeID"] for n in nodes if n.get("Alive") and HEAD_RESOURCE in n.get("Resources", {})), None)
    options: dict[str, Any] = {"name": controller_name(job), "namespace": NAMESPACE, "lifetime": "detached",
                               "num_cpus": 0, "max_concurrency": 16, "max_restarts": 0}
    if head is not None:
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(head, soft=False)
    if runtime_env:
        options["runtime_env"] = runtime_env
    controller = ray.remote(JobController).options(**options).remote(config)
    try:
        where = ray.get(controller.start.remote(), timeout=START_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - one line for the user; the controller is gone
        ray.kill(controller, no_restart=True)
        raise UserError(f"the job's controller did not start: {str(exc).strip().splitlines()[-1]}") from None
    return {"job": job, "generation": generation, "bundle": bundle, "nodes_with_room": room, **where}


def status(job: str, *, address: str | None = None) -> dict[str, Any]:
    """The job's status, in the shape `elasticyolo status --json` prints for the other engines."""
    keys = JobKeys(job)
    connect(address)
    return records.collect(records.GcsKV(), keys)


def cancel(job: str, *, address: str | None = None, reason: str = "cancelled by operator") -> bool:
    """Stop the job: its actors and placement groups go, its records stay. False: it was not running."""
    import ray

    keys = JobKeys(job)
    connect(address)
    controller = _controller(job)
    if controller is None:
        return False
    try:
        ray.get(controller.cancel.remote(reason), timeout=30)
    except Exception:  # noqa: BLE001 - killed while answering, or hung: make sure it is gone
        ray.kill(controller, no_restart=True)
        records.GcsKV().put_json(keys.state, {"state": "cancelled", "reason": reason, "at": time.time()})
    return True
