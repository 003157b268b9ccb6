"""The Ray job controller: one detached actor per job, on the head node, that does for a Ray job
what the agents and the leader's coordinator do for the other engines.

Its loop (a thread), every `TICK_S` or at once when something happens:
1. reads Ray's node table, the pending placement group (`ray.wait` on its `ready()`), and the
   training actors' `train()` results: an actor that died resolves its result with Ray's
   actor-death error (its worker process died, or its node did), which is the notification the
   controller acts on;
2. when a member reports that its world's collective failed, finds which of the world's other
   actors are gone: one whose lifeline closed (`lifeline.py`: its process ended) at once, and one
   that does not answer a ping within `PING_S` is on a node that is frozen or cut off (Ray itself
   declares a node dead only after its health checks fail, seconds later);
3. decides the cluster side with `plan.plan_cluster` (placement groups, actors, drains) and the
   next world with the torch engine's `plan_world`, and applies both: the world is written to the
   job's store (`store.py`, `world/<uuid>`), where every training actor waits for it;
4. writes the job's records to Ray's GCS KV (`records.py`) for `elasticyolo ray status`.

Member records arrive by actor call (`record`), spot notices too (`notice`, from the watcher in
slot 0 of each node). The job ends when rank 0 returns `done` (or on `cancel`): every actor is
killed, the placement groups removed, and the controller kills itself.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elasticyolo.cluster.keys import JobKeys
from elasticyolo.engines.ray import records
from elasticyolo.engines.ray.lifeline import LifelineServer
from elasticyolo.engines.ray.plan import ClusterInputs, HeldNode, Slot, node_name, plan_cluster
from elasticyolo.engines.torch.world_plan import MemberRecord, World, WorldInputs, plan_world
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.ray.controller")

TICK_S = 0.1
# After a member reports that its world's collective failed, an actor of that world that did not
# report it too and does not answer a ping within this long is lost (its node is gone or frozen).
PING_S = 1.0
DRAIN_READ_S = 0.5  # how often Ray's own drain state is read
START_FAILURES = 3  # training actors that raised before joining: the job fails with the last one's error
NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class JobConfig:
    """A job's settings beside its spec (`job.py` builds it)."""

    job: str
    spec_json: str
    generation: int
    min_nodes: int
    max_nodes: int
    slots: int
    bundle: dict[str, float]  # one slot's resources
    work_root: str
    notices: dict[str, Any] = field(default_factory=dict)
    runtime_env: dict[str, Any] | None = None


@dataclass
class SlotActor:
    handle: Any
    result: Any  # the ObjectRef of its train()


@dataclass
class Held:
    pg: PlacementGroup
    ray_node_id: str
    slots: list[Slot]
    actors: dict[int, SlotActor] = field(default_factory=dict)
    draining: dict[str, Any] | None = None  # the notice
    lost: bool = False
    host: str | None = None
    started_at: float = field(default_factory=time.time)


class JobController:
    """The actor's body (`job.py` starts it as a detached, named Ray actor)."""

    def __init__(self, config: JobConfig) -> None:
        from elasticyolo.engines.ray import store as job_store

        self.config, self.keys, self.kv = config, JobKeys(config.job), records.GcsKV()
        self.host = ray.util.get_node_ip_address()
        self.store = job_store.serve(self.host)
        self.port = int(self.store.port)
        self.me = ray.get_runtime_context().current_actor
        self.node_id = ray.get_runtime_context().get_node_id()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.lifelines = LifelineServer(self.host, on_close=lambda _slot: self.wake.set())
        self.records: dict[str, MemberRecord] = {}
        self.held: dict[str, Held] = {}
        self.ever_held: set[str] = set()  # Ray node ids held or drained: the pending placement group avoids them
        self.pending: PlacementGroup | None = None
        self.world: World | None = None
        self.pinged: set[int] = set()  # worlds whose failure was checked by pinging their actors
        self.dead_members: set[str] = set()  # members whose actors Ray reported dead
        self.state: dict[str, Any] = {"state": "submitted", "generation": config.generation, "at": time.time()}
        self.events: list[dict[str, Any]] = []
        self.ended = False
        self.start_failures = 0
        self._drain_read_at = 0.0
        self._thread = threading.Thread(target=self._run, name="ray-job-controller", daemon=True)
        self.kv.put_json(self.keys.leader, {"node_id": node_name(self.node_id), "pid": os.getpid()})
        self._publish_state()

    # ---- actor methods -----------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        self._thread.start()
        return {"host": self.host, "port": self.port, "node": node_name(self.node_id)}

    def hello(self) -> None:
        """A training actor's first call (its Ray connection to this actor is then open)."""

    def record(self, raw: str) -> None:
        rec = MemberRecord.from_json(json.loads(raw))
        with self.lock:
            self.records[rec.member] = rec
        self.wake.set()

    def notice(self, node: str, notice: dict[str, Any]) -> None:
        with self.lock:
            held = self.held.get(node)
            if held is None or held.draining is not None or not notice.get("drain", True):
                return
            held.draining = notice
            deadline = notice.get("deadline")
            left = round(float(deadline) - time.time(), 1) if isinstance(deadline, (int, float)) else None
            self._event({"kind": "notice", "node": node, "provider": notice.get("source"),
                         "notice_kind": notice.get("kind"), "drain": True, "seconds_left": left})
            self._event({"kind": "drain_start", "node": node,
                         "reason": "Ray drains the node" if notice.get("source") == "ray" else "spot notice",
                         "deadline_in_s": left})
        log.info("spot notice: draining", node=node)
        self.wake.set()

    def cancel(self, reason: str = "cancelled") -> None:
        self._end("cancelled", reason)

    # ---- the loop ----------------------------------------------------------------------------
    def _run(self) -> None:
        while not self.ended:
            try:
                self._tick()
            except Exception as exc:  # noqa: BLE001 - a GCS hiccup: the next tick retries
                log.warning("controller tick failed; retrying", error=str(exc))
                time.sleep(0.5)
            self.wake.wait(TICK_S)
            self.wake.clear()
        self._stop_everything()

    def _tick(self) -> None:
        alive = frozenset(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        for name in self._draining_in_ray():
            self.notice(name, {"action": "drain", "kind": "ray-drain", "source": "ray", "drain": True,
                               "deadline": None, "received_at": time.time()})
        self._adopt_pending()
        self._collect_results()
        self._check_failed_world()
        with self.lock:
            actions = plan_cluster(ClusterInputs(
                held={name: HeldNode(h.ray_node_id, tuple(h.slots), draining=h.draining is not None, lost=h.lost)
                      for name, h in self.held.items()},
                alive=alive, pending=self.pending is not None, max_nodes=self.config.max_nodes, ended=self.ended))
        for name in actions.release:
            self._release(name, lost=name in actions.lost)
        for name, slot in actions.leave:
            self._ask_to_leave(name, slot)
        for name, slot in actions.start:
            self._start_actor(name, slot)
        if actions.ask_for_node:
            self._ask_for_node()
        self._plan_world(actions.lost)
        self._publish_nodes()

    # ---- nodes -------------------------------------------------------------------------------
    def _draining_in_ray(self) -> list[str]:
        """The held nodes Ray is draining (`ray drain-node`, the autoscaler, KubeRay on a spot
        preemption): the autoscaler's view of the cluster (`autoscaler.v2.sdk`), read at most
        every `DRAIN_READ_S`."""
        now = time.monotonic()
        if now - self._drain_read_at < DRAIN_READ_S:
            return []
        self._drain_read_at = now
        try:
            from ray.autoscaler.v2.sdk import get_cluster_resource_state
            from ray.core.generated.autoscaler_pb2 import NodeStatus

            state = get_cluster_resource_state(ray._private.worker.global_worker.gcs_client)
            draining = {ns.node_id.hex() for ns in state.node_states if ns.status == NodeStatus.DRAINING}
        except Exception as exc:  # noqa: BLE001 - an older Ray or a GCS hiccup: the spot watcher still drains
            log.debug("Ray's drain state unreadable", error=str(exc))
            return []
        with self.lock:
            return [name for name, h in self.held.items() if h.ray_node_id in draining and h.draining is None]

    def _ask_for_node(self) -> None:
        bundles = [dict(self.config.bundle) for _ in range(self.config.slots)]
        selector = None
        if self.ever_held:
            selector = [{NODE_ID_LABEL: f"!in({','.join(sorted(self.ever_held))})"} for _ in bundles]
        self.pending = placement_group(bundles, strategy="STRICT_PACK", bundle_label_selector=selector)

    def _adopt_pending(self) -> None:
        pg = self.pending
        if pg is None:
            return
        ready, _ = ray.wait([pg.ready()], timeout=0)
        if not ready:
            return
        ray_node = placement_group_table(pg)["bundles_to_node_id"][0]
        name = node_name(ray_node)
        host = next((n.get("NodeManagerAddress") for n in ray.nodes() if n["NodeID"] == ray_node), None)
        with self.lock:
            self.pending = None
            self.ever_held.add(ray_node)
            self.held[name] = Held(pg, ray_node, [Slot.EMPTY] * self.config.slots, host=host)
        log.info("node taken", node=name, ray_node=ray_node)

    def _start_actor(self, name: str, slot: int) -> None:
        from elasticyolo.engines.ray.worker import SlotSetup, TrainingActor

        held = self.held[name]
        c = self.config
        setup = SlotSetup(spec_json=c.spec_json, job=c.job, generation=c.generation, node=name, slot=slot,
                          slots=c.slots, work_root=c.work_root, store_host=self.host, store_port=self.port,
                          lifeline_port=self.lifelines.port, controller=self.me, notices=c.notices)
        options: dict[str, Any] = {
            "num_cpus": c.bundle.get("CPU", 0), "num_gpus": c.bundle.get("GPU", 0), "max_concurrency": 4,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(held.pg, placement_group_bundle_index=slot),
            "name": None,
        }
        if c.runtime_env:
            options["runtime_env"] = c.runtime_env
        handle = ray.remote(TrainingActor).options(**options).remote(setup)
        held.actors[slot] = SlotActor(handle, handle.train.remote())
        held.slots[slot] = Slot.RUNNING
        log.info("training actor started", node=name, slot=slot)

    def _ask_to_leave(self, name: str, slot: int) -> None:
        held = self.held[name]
        actor = held.actors.get(slot)
        if actor is not None:
            actor.handle.leave.remote()
        held.slots[slot] = Slot.LEAVING

    def _release(self, name: str, lost: bool) -> None:
        with self.lock:
            held = self.held.pop(name, None)
        if held is None:
            return
        for actor in held.actors.values():
            ray.kill(actor.handle, no_restart=True)
        try:
            remove_placement_group(held.pg)
        except Exception as exc:  # noqa: BLE001 - gone with its node already
            log.debug("placement group not removed", error=str(exc))
        if held.draining is None:
            self.ever_held.discard(held.ray_node_id)  # alive again (a false loss), it may be taken again
        if held.draining is not None:
            self._event({"kind": "drain_end", "node": name, "mode": "leave", "lost_steps": 0,
                         "notice_to_drained_s": round(time.time() - float(held.draining.get("received_at")
                                                                           or time.time()), 2)})
        log.info("node let go", node=name, lost=lost)

    # ---- actors ------------------------------------------------------------------------------
    def _collect_results(self) -> None:
        by_ref = {a.result: (name, slot, a) for name, h in list(self.held.items()) for slot, a in h.actors.items()}
        if not by_ref:
            return
        ready, _ = ray.wait(list(by_ref), num_returns=len(by_ref), timeout=0)
        for ref in ready:
            name, slot, actor = by_ref[ref]
            held = self.held.get(name)
            if held is None:
                continue
            del held.actors[slot]
            try:
                result = ray.get(ref)
            except RayActorError as exc:
                log.info("training actor died", node=name, slot=slot, error=str(exc).splitlines()[0])
                with self.lock:  # its records go with it (the launcher's rule)
                    mine = [m for m in self.records if m.startswith(f"{name}.{slot}.")]
                    for m in mine:
                        del self.records[m]
                self.dead_members.update(mine)
                held.slots[slot] = Slot.ENDED if held.draining is not None else Slot.EMPTY
                if isinstance(exc, ActorUnavailableError) and self.lifelines.closed(name, slot):
                    # Its process ended and its raylet did not say so: the node is gone (Ray
                    # declares it dead only when its health checks fail).
                    held.lost = True
                if not mine and held.draining is None and actor_failed(exc):
                    self.start_failures += 1  # it died before it joined: a bad spec or environment
                    if self.start_failures >= START_FAILURES:
                        self._end("failed", f"training actors fail to start: {last_line(exc)}")
                continue
            except RayError as exc:
                result = {"result": "failed", "error": str(exc).splitlines()[0]}
            log.info("training actor returned", node=name, slot=slot, result=result)
            held.slots[slot] = Slot.ENDED
            ray.kill(actor.handle, no_restart=True)  # a group left mid-collective must not hold it
            if result.get("result") == "done":
                self._end("done", "")
            elif result.get("result") == "failed":
                self._end("failed", f"{name} slot {slot}: {result.get('error')}")

    def _check_failed_world(self) -> None:
        world = self.world
        if world is None or world.uuid in self.pinged:
            return
        with self.lock:
            reported = {r.member for r in self.records.values() if r.failed == world.uuid}
        if not reported:
            return
        self.pinged.add(world.uuid)
        by_member: dict[Any, str] = {}
        dead: set[str] = set()
        for member, node in zip(world.members, world.nodes):
            held = self.held.get(node)
            if member in reported:
                continue  # it reported the failure: alive (a busy host must not make it look dead)
            slot = int(member.split(".")[1])
            if self.lifelines.closed(node, slot):
                dead.add(node)  # its process ended
            elif held is not None and slot in held.actors:
                by_member[held.actors[slot].handle.pid.remote()] = node
        answered, late = ray.wait(list(by_member), num_returns=len(by_member), timeout=PING_S)
        dead |= {by_member[r] for r in late}
        for r in answered:
            try:
                ray.get(r)
            except RayError:
                dead.add(by_member[r])
        for node in dead:
            if node in self.held:
                self.held[node].lost = True
        if dead:
            log.info("world failed; nodes that did not answer are lost", uuid=world.uuid, nodes=sorted(dead))

    # ---- the world ---------------------------------------------------------------------------
    def _plan_world(self, lost: frozenset[str]) -> None:
        from elasticyolo.engines.ray.world_source import LATEST_KEY, world_key

        with self.lock:
            records_now = dict(self.records)
            present = frozenset(self.held)
        absent = frozenset({r.node for r in records_now.values()} - present)
        nxt = plan_world(WorldInputs(current=self.world, records=records_now, lost_nodes=lost | absent,
                                     absent_nodes=absent, min_nodes=self.config.min_nodes,
                                     max_nodes=self.config.max_nodes))
        if nxt is None:
            return
        gone = set(self.world.members if self.world else ()) - set(nxt.members)
        if gone & self.dead_members and not nxt.abort:
            # A member Ray reported dead: a survivor may be blocked on it in a collective that never
            # fails (a frozen node declared dead); the survivors abort it (`TorchWorld._on_world`).
            nxt = replace(nxt, abort=True)
        value = json.dumps({**nxt.to_json(), "generation": self.config.generation, "at": time.time()})
        self.store.set(world_key(nxt.uuid), value)
        self.store.set(LATEST_KEY, str(nxt.uuid))
        self.world = nxt
        self.kv.put(self.keys.world, value)
        if self.state["state"] == "submitted":
            self._set_state("running", "")
        log.info("world published", uuid=nxt.uuid, world_size=nxt.size, abort=nxt.abort, reason=nxt.reason)

    # ---- records and the end -----------------------------------------------------------------
    def _nodes_record(self) -> list[dict[str, Any]]:
        out = []
        for name, h in sorted(self.held.items()):
            state = "DRAINING" if h.draining is not None else ("LOST" if h.lost else "TRAINING")
            out.append({"id": name, "ray_node_id": h.ray_node_id, "state": state, "slots": len(h.slots),
                        "host": h.host, "notice": h.draining, "started_at": h.started_at})
        return out

    def _publish_nodes(self) -> None:
        with self.lock:
            nodes = self._nodes_record()
        if nodes != getattr(self, "_published_nodes", None):
            self.kv.put_json(records.nodes_key(self.keys), nodes)
            self._published_nodes = nodes

    def _event(self, ev: dict[str, Any]) -> None:
        self.events = (self.events + [{"at": time.time(), **ev}])[-records.EVENTS_KEPT:]
        try:
            self.kv.put_json(records.events_key(self.keys), self.events)
        except Exception as exc:  # noqa: BLE001 - status only
            log.debug("events not written", error=str(exc))

    def _set_state(self, state: str, reason: str) -> None:
        self.state = {"state": state, "reason": reason or None, "generation": self.config.generation,
                      "at": time.time()}
        self._publish_state()

    def _publish_state(self) -> None:
        self.kv.put_json(self.keys.state, self.state)

    def _end(self, state: str, reason: str) -> None:
        if self.ended:
            return
        log.info("job ended", state=state, reason=reason)
        self._set_state(state, reason)
        self.ended = True
        self.wake.set()

    def _stop_everything(self) -> None:
        for name in list(self.held):
            self._release(name, lost=False)
        if self.pending is not None:
            remove_placement_group(self.pending)
        self.kv.put_json(records.nodes_key(self.keys), [])
        ray.kill(self.me, no_restart=True)


def actor_failed(exc: RayActorError) -> bool:
    """The actor raised (its constructor or `train()`), rather than its process or node dying."""
    return "Traceback" in str(exc)


def last_line(exc: BaseException) -> str:
    """The error a traceback ends with (`FileNotFoundError: ...`)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if ":" in line and line.split(":")[0].endswith(("Error", "Exception"))]
    return (errors[-1] if errors else lines[-1] if lines else type(exc).__name__)[:300]
