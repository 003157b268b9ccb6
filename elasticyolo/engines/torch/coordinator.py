"""The torch engine's world coordinator: on the leader, publish each new world (agent side, no torch).

The decision is `world_plan.plan_world`; this executor gathers its inputs and writes its result:
* the member records (`torch/<gen>/members/`), the node records and the current world (`world`),
  read from etcd whenever one of them changes (one watch on the job's prefix) and at least every
  `POLL_S`; rank 0's step comes from the same watch's `progress` events, which are only noted:
  the step changes twice a second and alone decides nothing until the world stops stepping;
* the lost nodes: the leader's liveness verdicts (`engines/world_health.py`: every DEAD node, a
  SUSPECT one while the world does not step); a node whose record stayed away longer than the
  lease grace (a lapse that re-registers within it costs its worker nothing); and at once a node
  without a record whose world's collective failed on the other members (a leader that died with
  its node: the next leader never had its liveness connection, and a lapse breaks no collective);
* the new world is written with a compare-and-swap on the `world` key's revision, so two leaders
  for a moment (one deposed) never both advance it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from elasticyolo.cluster.liveness import Verdict
from elasticyolo.engines.torch.world_plan import MemberRecord, World, WorldInputs, plan_world
from elasticyolo.engines.world_health import lost_nodes, note_step, world_stalled
from elasticyolo.log import get_logger

if TYPE_CHECKING:
    from elasticyolo.agent.plugin import NodeAPI
    from elasticyolo.cluster.etcd import EtcdClient

log = get_logger("elasticyolo.torch.coordinator")

POLL_S = 0.25  # re-read at least this often (a missed watch event, a grace or a stall running out)
KEEP_STORE_WORLDS = 2  # the store keeps the reconfiguration keys of this many newest worlds


@dataclass
class StepSeen:
    step: int | None = None
    step_changed_at: float | None = None
    step_period_s: float | None = None


@dataclass
class CoordinatorMemory:
    """What the executor carries between reads (updated in place)."""

    steps: StepSeen = field(default_factory=StepSeen)
    missing_since: dict[str, float] = field(default_factory=dict)  # node -> first read without its record


def member_records(client: "EtcdClient", prefix: str) -> dict[str, MemberRecord]:
    """member -> its record, for the readable records under `prefix` (`JobKeys.torch_members`)."""
    records = {}
    for _, value, _ in client.get_prefix(prefix):
        try:
            rec = MemberRecord.from_json(json.loads(value))
        except (ValueError, KeyError, TypeError):
            continue
        records[rec.member] = rec
    return records


def nodes_gone(present: set[str], wanted: set[str], memory: CoordinatorMemory, now: float, grace_s: float) -> set[str]:
    """The nodes in `wanted` whose record has been missing longer than `grace_s` (updates `memory`)."""
    for node in present:
        memory.missing_since.pop(node, None)
    gone = set()
    for node in wanted - present:
        if now - memory.missing_since.setdefault(node, now) >= grace_s:
            gone.add(node)
    return gone


class WorldCoordinator:
    def __init__(self, agent: "NodeAPI", generation: int, min_nodes: int, max_nodes: int,
                 record_grace_s: float) -> None:
        self.agent, self.generation = agent, generation
        self.min_nodes, self.max_nodes, self.record_grace_s = min_nodes, max_nodes, record_grace_s
        self.keys = agent.keys
        self.members_prefix = self.keys.torch_members(generation)
        self.memory = CoordinatorMemory()
        self._steps_lock = threading.Lock()  # memory.steps: noted by the watch, read by the loop
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._client: "EtcdClient | None" = None
        self._cancel_watch: Any = None
        self._thread = threading.Thread(target=self._run, name="torch-coordinator", daemon=True)

    def start(self) -> None:
        log.info("torch world coordinator started", generation=self.generation)
        if self.agent.liveness is not None:
            self.agent.liveness.add_listener(self._on_liveness)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.agent.liveness is not None:
            self.agent.liveness.remove_listener(self._on_liveness)
        if self._cancel_watch is not None:
            self._cancel_watch()
        self._thread.join(5.0)
        log.info("torch world coordinator stopped", generation=self.generation)

    def _on_liveness(self, changes: dict[str, Verdict]) -> None:
        self._wake.set()

    # ---- the loop --------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._client is None:
                    self._client = self.agent.new_client(timeout=2.0)
                    self._watch(self._client)
                self.step(self._client)
            except Exception as exc:  # noqa: BLE001 - etcd hiccup: the next round retries
                log.warning("torch world coordinator round failed; retrying", error=str(exc))
                self._stop.wait(0.2)
            self._wake.wait(POLL_S)
            self._wake.clear()

    def _watch(self, client: "EtcdClient") -> None:
        keys = self.keys
        relevant = (self.members_prefix, keys.nodes, keys.suspects, keys.world)
        self._note_progress(client.get(keys.progress))
        events, self._cancel_watch = client.watch_prefix(keys.prefix)

        def pump() -> None:
            try:
                for ev in events:
                    if ev.key == keys.progress:
                        self._note_progress((ev.value, ev.mod_revision) if ev.type == "PUT" else None)
                    elif ev.key.startswith(relevant):
                        self._wake.set()
            except Exception as exc:  # noqa: BLE001 - the poll still runs
                log.debug("coordinator watch ended", error=str(exc))

        threading.Thread(target=pump, name="torch-coordinator-watch", daemon=True).start()

    def _note_progress(self, kv: "tuple[bytes, int] | None") -> None:
        step = _json(kv[0]).get("step") if kv is not None else None
        if step is not None:
            with self._steps_lock:
                note_step(int(step), self.memory.steps, time.monotonic())

    def step(self, client: "EtcdClient") -> World | None:
        """One read, decide, write. Returns the world it published, if any."""
        keys, now = self.keys, time.monotonic()
        world_kv = client.get(keys.world)
        records = member_records(client, self.members_prefix)
        node_recs = {key[len(keys.nodes):]: value for key, value, _ in client.get_prefix(keys.nodes)}
        current, revision = None, 0
        if world_kv is not None:
            revision = world_kv[1]
            data = _json(world_kv[0])
            if data.get("generation") == self.generation:
                current = World.from_json(data)
        lost = self._lost(records, node_recs, current, now)
        absent = frozenset({r.node for r in records.values()} - set(node_recs))
        nxt = plan_world(WorldInputs(current=current, records=records, lost_nodes=frozenset(lost),
                                     absent_nodes=absent, min_nodes=self.min_nodes, max_nodes=self.max_nodes))
        if nxt is None:
            return None
        value = {**nxt.to_json(), "generation": self.generation, "term": self.agent.election.term,
                 "leader": self.agent.cfg.node_id, "at": time.time()}
        ok, _ = client.compare_and_swap(keys.world, json.dumps(value), revision)
        if not ok:
            self._wake.set()  # someone else advanced it: decide again from what is there now
            return None
        log.info("torch world published", uuid=nxt.uuid, world_size=nxt.size, abort=nxt.abort, reason=nxt.reason,
                 lost=sorted(lost))
        self._prune_store(client, nxt.uuid)
        return nxt

    def _lost(self, records: dict[str, MemberRecord], node_recs: dict[str, bytes], current: World | None,
              now: float) -> set[str]:
        wanted = {r.node for r in records.values()} | set(current.nodes if current else ())
        gone = nodes_gone(set(node_recs), wanted, self.memory, now, self.record_grace_s)
        if current is not None and any(r.failed == current.uuid for r in records.values()):
            gone |= wanted - set(node_recs)
        liveness = self.agent.liveness
        if liveness is None:
            return gone
        verdicts = {}
        for node in wanted:
            token = None
            if node in node_recs:
                token = str(_json(node_recs[node]).get("liveness_token") or "")
            verdicts[node] = liveness.verdict(node, token)
        with self._steps_lock:
            steps = self.memory.steps
            stalled = world_stalled(steps.step_changed_at, steps.step_period_s, now)
        return gone | lost_nodes(verdicts, stalled)

    def _prune_store(self, client: "EtcdClient", uuid: int) -> None:
        old = uuid - KEEP_STORE_WORLDS
        if old >= 1:
            try:
                client.delete_prefix(f"{self.keys.torch_store(self.generation)}reconfigure/{old}/")
            except Exception as exc:  # noqa: BLE001 - housekeeping only
                log.debug("store keys not pruned", error=str(exc))


def _json(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw)
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}
