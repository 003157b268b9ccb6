"""The agent loop: observe etcd, let `state.decide` pick a transition, apply it, lead if elected.

Level-triggered: each iteration re-reads what it needs, so a missed watch event or an etcd
hiccup only delays a decision. A watch on the job prefix wakes the loop early; otherwise it
ticks about four times per TTL. Transient etcd errors are logged and retried, never fatal.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from elasticyolo import __version__
from elasticyolo.agent.billing import BillingLedger
from elasticyolo.agent.dead_nodes import VerdictPublisher
from elasticyolo.agent.job import JobView
from elasticyolo.agent.metrics import AgentMetrics
from elasticyolo.agent.plugin import LEASE_LAPSED, AgentPlugin
from elasticyolo.agent.sd_notify import SystemdNotifier
from elasticyolo.agent.state import NodeState, Observation, Transition, decide, reregisters_in_place
from elasticyolo.cluster.election import LeaderElection
from elasticyolo.cluster.etcd import EtcdClient, EtcdError, b64
from elasticyolo.cluster.jobs import submit_spec
from elasticyolo.cluster.job_state import ENDED_STATES, JobState
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.liveness import LivenessClient, LivenessServer
from elasticyolo.cluster.registry import NodeIdTakenError, NodeRecord, NodeRegistration, read_nodes
from elasticyolo.cluster.settings import EtcdSettings
from elasticyolo.config import AgentConfig
from elasticyolo.cost import NodePrice, load_price_table, resolve_price
from elasticyolo.errors import UnavailableError, UserError
from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.worker_runtime.prewarm import prewarm_enabled

EVENTS_KEPT = 1000


def node_price(cfg: AgentConfig) -> NodePrice:
    """This node's price per hour and on-demand equivalent (elasticyolo/cost.py: where each comes from)."""
    table = load_price_table(cfg.price_table) if cfg.price_table else None
    return resolve_price(price_per_hour=cfg.price_per_hour, on_demand_per_hour=cfg.on_demand_price_per_hour,
                         instance_type=cfg.instance_type, preemptible=cfg.preemptible, table=table,
                         table_name=os.path.basename(cfg.price_table or ""))


@dataclass
class DrainStatus:
    """The drain in progress (`agent.plugin.DrainInfo`)."""

    reason: str | None = None
    started_at: float | None = None  # epoch s
    deadline: float = 0.0  # monotonic s; 0 when not draining
    report: dict[str, Any] = field(default_factory=dict)  # filled by engine plug-ins while draining


class Agent:
    """The node daemon, and the `NodeAPI` (agent/plugin.py) its plug-ins use."""

    def __init__(self, cfg: AgentConfig, client: EtcdClient | None = None,
                 plugins: Sequence[AgentPlugin] = (), notifier: SystemdNotifier | None = None) -> None:
        self.cfg = cfg
        self.keys = JobKeys(cfg.job)
        self.client = client or self.new_client()
        self.log = get_logger("elasticyolo.agent", node=cfg.node_id, job=cfg.job)
        self.plugins: list[AgentPlugin] = list(plugins)
        self.notifier = notifier or SystemdNotifier()
        self.metrics = AgentMetrics(cfg.node_id, cfg.job)
        self._state = NodeState.JOINING
        self._job = JobView(None, None, (0, 0))
        self._job_read = False
        price = node_price(cfg)
        self.record = NodeRecord(
            node_id=cfg.node_id, host=cfg.host, addr=cfg.addr, slots=cfg.slots, state=self.state.value,
            preemptible=cfg.preemptible, instance_type=cfg.instance_type, zone=cfg.zone,
            price_per_hour=price.per_hour, agent_version=__version__, started_at=time.time(),
            pid=os.getpid(), extra={"on_demand_per_hour": price.on_demand_per_hour, "price_source": price.source,
                                    # Nothing is warm yet: without this, an engine that offers a
                                    # node's ready slots would offer every slot until its warm
                                    # pool reports (a join then stalls the world for the whole
                                    # warm-up).
                                    **({"ready_slots": 0} if prewarm_enabled() else {})},
        )
        self.registration = NodeRegistration(self.client, self.keys, self.record, cfg.ttl,
                                             on_lease_lost=self.wake, on_renew=self.metrics.observe_renew,
                                             keepalive_client=self.new_client())
        # A follower waits for a leader whose lease lapsed to take its lead back (two leases'
        # time, while that leader's agent still holds its liveness connection open).
        self.election = LeaderElection(self.client, self.keys, self.registration, handover=cfg.handover,
                                       reclaim_grace_s=2.0 * cfg.ttl, leader_reachable=self._leader_reachable)
        self.billing = BillingLedger(self.client, self.keys, self.record)
        self.tick_s = min(1.0, max(0.1, cfg.ttl / 4))
        if self.notifier.watchdog_s:
            self.tick_s = min(self.tick_s, self.notifier.watchdog_s / 3)
        self._wake = threading.Event()
        self.drain = DrainStatus()
        self._notice_deadline: float | None = None  # epoch s: the earliest draining notice's deadline
        # Set by the CLI to the spot watcher's inject_signal: SIGTERM/SIGINT become notices.
        self.signal_sink: Callable[[int], None] | None = None
        self._conflict_since: float | None = None
        self._lapsed = False  # the lease lapsed and the node has not registered again yet
        self._fatal: str | None = None
        self._event_seq = 0
        self._record_dirty = False
        self._last_trim = 0.0
        self._watch_cancel: Callable[[], None] | None = None
        self.metrics_port: int | None = None
        # Fast failure signals (cluster/liveness.py): every agent listens (the leader's server is
        # the one in use) and keeps a heartbeat connection to the current leader.
        self.liveness: LivenessServer | None = None
        self.verdicts: VerdictPublisher | None = None
        self.liveness_client = LivenessClient(cfg.node_id, cfg.heartbeat_interval_s, self.lease_id,
                                              token=secrets.token_hex(16))

    # ---- NodeAPI: what plug-ins and signal handlers use --------------------------------------
    @property
    def state(self) -> NodeState:
        return self._state

    @property
    def job(self) -> JobView:
        return self._job

    def lease_id(self) -> int:
        return self.registration.lease_id

    def new_client(self, timeout: float | None = None) -> EtcdClient:
        """A client with the agent's settings; `timeout` also bounds its retries (else the agent's)."""
        cfg, settings = self.cfg, EtcdSettings.from_config(self.cfg)
        if timeout is not None:
            return settings.client(timeout=timeout, retry_window=timeout)
        return settings.client(timeout=cfg.etcd_timeout, retry_window=max(cfg.etcd_timeout, cfg.ttl / 2))

    def _job_view(self) -> dict[str, Any]:
        """The job as `status --json` shows it (for /metrics scrapes; its own short-timeout client)."""
        from elasticyolo.status import collect

        return collect(self._scrape_client(), self.keys, lease_ttls=False)

    def _scrape_client(self) -> EtcdClient:
        if getattr(self, "_scrape_etcd", None) is None:
            self._scrape_etcd = self.new_client(timeout=2.0)
        return self._scrape_etcd

    def wake(self) -> None:
        self._wake.set()

    def set_record_field(self, name: str, value: Any) -> None:
        """Set (None: remove) an extra field of this node's record; written at the end of the
        loop iteration (or with the next registration)."""
        extra = self.record.extra
        if (value is None and name not in extra) or (value is not None and extra.get(name) == value):
            return
        if value is None:
            extra.pop(name, None)
        else:
            extra[name] = value
        self._record_dirty = True
        self.wake()

    def request_drain(self, reason: str, notice: dict[str, Any] | None = None,
                      deadline: float | None = None) -> None:
        """Leave the world cleanly (thread-safe; signal handlers and spot pollers call this).
        `deadline`: epoch seconds by which the node may be gone; the drain then ends
        `drain_margin_s` before it (or after `drain_timeout_s`, whichever comes first)."""
        if self.drain.reason is None:
            self.drain.reason = reason
        if deadline is not None and (self._notice_deadline is None or deadline < self._notice_deadline):
            self._notice_deadline = deadline
            if self.state is NodeState.DRAINING:
                self.drain.deadline = min(self.drain.deadline, self._deadline_from_notice())
        if notice is not None:
            self.set_notice(notice)
        self.wake()

    def _deadline_from_notice(self) -> float:
        if self._notice_deadline is None:
            return float("inf")
        return time.monotonic() + (self._notice_deadline - time.time()) - self.cfg.drain_margin_s

    def resign(self, reason: str) -> None:
        """Give up leadership now (a draining leader after its handover)."""
        if self.election.is_leader:
            self.election.resign(reason)
            self.record.leader = False
            self._record_dirty = True
            self._lost_leadership(reason)

    def write_event(self, kind: str, **fields: Any) -> None:
        """Append to the job's event log in etcd (best effort; `status` shows the newest)."""
        self._event_seq += 1
        event = {"at": time.time(), "node": self.cfg.node_id, "kind": kind, **fields}
        try:
            self.client.put(self.keys.event(int(time.time() * 1000), self.cfg.node_id, self._event_seq),
                            json.dumps(event))
        except (UnavailableError, EtcdError) as exc:
            self.log.warning("could not write event", kind=kind, error=str(exc))

    def set_notice(self, notice: dict[str, Any]) -> None:
        """Record an interruption notice in the node record (shown by `status`)."""
        self.metrics.notices.inc()
        self.record.notice = notice
        self._record_dirty = True
        self.wake()

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    # ---- main loop ----------------------------------------------------------------------
    def run(self) -> int:
        """Run until LEFT (0) or FAILED (1). Raises UnavailableError if etcd never answers at start."""
        self._install_signal_handlers()
        if self.cfg.metrics_port is not None:
            self.metrics.add_job_view(self._job_view)
            self.metrics_port = self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_addr)
            self.log.info("metrics listening", addr=self.cfg.metrics_addr, port=self.metrics_port)
        self._wait_for_etcd()
        self._start_liveness()
        self._call_plugins("on_start")
        self._submit_config_spec()
        self._start_watch()
        self.log.info("agent started", state=self.state.value, ttl=self.cfg.ttl, etcd=",".join(self.cfg.etcd),
                      version=__version__)
        try:
            while not self.state.terminal:
                self._iterate()
                if self.notifier.watchdog_s:
                    self.notifier.watchdog()
                if not self.state.terminal:
                    self._wake.wait(self.tick_s)
                    self._wake.clear()
        finally:
            self._shutdown()
        return 0 if self.state is NodeState.LEFT else 1

    def _iterate(self) -> None:
        try:
            # A leader whose lease may have expired steps down first thing: cut off from etcd, the
            # reads below fail every time, and etcd hands the lead to another node at the TTL.
            if self.election.is_leader and not self.registration.lease_valid():
                self._lead()
            obs = self._observe()
            transition = decide(self.state, obs)
            if transition is not None:
                self._apply(transition)
            if self.state in (NodeState.IDLE, NodeState.TRAINING):
                self._lead()
            # Heartbeats only from a registered member (a restarting agent must not revive its
            # predecessor's record before it has registered itself).
            leader = self.election.leader
            member = self.state in (NodeState.IDLE, NodeState.TRAINING, NodeState.DRAINING)
            self.liveness_client.follow(leader.liveness or None if member and leader is not None
                                        and not self.election.is_leader else None)
            if self._record_dirty and self.registration.lease_valid():
                self._record_dirty = False
                self._sync_record()
            if member and self.billing.due(time.monotonic()):
                self.billing.write()
            self._call_plugins("on_tick")
        except UnavailableError as exc:
            self.metrics.etcd_errors.inc()
            self.log.warning("etcd unavailable; will retry", error=str(exc))
        except EtcdError as exc:
            self.metrics.etcd_errors.inc()
            self.log.warning("etcd refused a request; will retry", error=str(exc))

    def _observe(self) -> Observation:
        if self.state is NodeState.JOINING and not self.drain.reason:
            self._try_register()
        if self.state is NodeState.DRAINING:
            return Observation(registered=True, drain_complete=self._drain_step())
        if reregisters_in_place(self.state, self._registration_observation()):
            self._reregister_in_place()
        self._read_job()
        return replace(self._registration_observation(), job_active=self.job.active,
                       drain_requested=self.drain.reason is not None, fatal=self._fatal)

    def _registration_observation(self) -> Observation:
        return Observation(registered=bool(self.registration.lease_id) and not self.registration.lease_lost(),
                           lease_lost=self.registration.lease_lost())

    def _reregister_in_place(self) -> None:
        """A member's lease lapsed: register again under a new lease, keeping the node's state and
        its workers (agent/state.py). A leader's key went with the old lease: it leads no more."""
        if not self._lapsed:  # once per lapse, however many tries the registration takes
            self._lapsed = True
            if self.election.is_leader:
                self.election.term = 0
                self._lost_leadership(LEASE_LAPSED)
            self.metrics.lease_lapses.inc()
            self.log.warning("lease lapsed; re-registering in place", state=self.state.value)
        if self._try_register(keep_state=True):
            self._lapsed = False
            self.write_event("lease", lapse=True, state=self.state.value)

    def _try_register(self, keep_state: bool = False) -> bool:
        """Register under a new lease; True once registered. `keep_state`: the record keeps the
        node's state (a member re-registering after a lapse) instead of JOINING."""
        if self.registration.lease_id and not self.registration.lease_lost():
            return False
        self.registration.stop_keepalive()
        self.registration.lease_id = 0
        if not keep_state:
            self.record.state = NodeState.JOINING.value
        self.record.leader = False
        try:
            self.registration.register()
        except NodeIdTakenError as exc:
            # A previous incarnation's lease may still be alive (crash + quick restart): wait it out.
            now = time.monotonic()
            self._conflict_since = self._conflict_since or now
            if now - self._conflict_since > 2 * self.cfg.ttl + 1:
                self._fatal = str(exc)
            else:
                self.log.info("node id still registered; waiting for the old lease to expire", error=str(exc))
            return False
        self._conflict_since = None
        self.registration.start_keepalive()
        self.log.info("registered", lease=f"{self.registration.lease_id:x}", ttl=self.cfg.ttl)
        return True

    def _read_job(self) -> None:
        got = self.client.get_many([self.keys.spec, self.keys.state, self.keys.world])
        spec_kv, state_kv, world_kv = got[self.keys.spec], got[self.keys.state], got[self.keys.world]
        revision = (spec_kv[1] if spec_kv else 0, state_kv[1] if state_kv else 0)
        if world_kv is not None:
            try:
                self.metrics.world_size.set(float(json.loads(world_kv[0]).get("world_size", 0)))
            except (ValueError, TypeError, AttributeError):
                pass
        first_read, self._job_read = not self._job_read, True
        if revision == self.job.revision:
            return
        spec, error = None, None
        if spec_kv is not None:
            try:
                spec = TrainSpec.from_json(spec_kv[0], where=f"stored spec {self.keys.spec}")
            except UserError as exc:
                error = str(exc)
                self.log.error("stored job spec is invalid; ignoring it", error=error)
        state = None
        if state_kv is not None:
            try:
                state = str(json.loads(state_kv[0]).get("state"))
            except (ValueError, TypeError, AttributeError):
                state = None
        elif spec is not None:
            state = JobState.SUBMITTED.value  # a spec written without a state record counts as submitted
        # A job seen ending (not one that had ended before this agent started).
        ended = state in ENDED_STATES and self._job.state != state and not first_read
        self._job = JobView(spec, state, revision, error)
        self.log.info("job changed", job_state=state, has_spec=spec is not None, active=self.job.active)
        if ended and self.election.is_leader:
            self._log_cost_summary(state)
        self._call_plugins("on_job_change", self.job)

    def _log_cost_summary(self, state: str | None) -> None:
        """One line at the job's end (the leader): what it cost, on-demand equivalent, $/epoch."""
        from elasticyolo.cost import summary_line
        from elasticyolo.status import collect

        try:
            view = collect(self.client, self.keys, lease_ttls=False)
        except Exception as exc:  # noqa: BLE001 - a summary must not disturb the agent
            self.log.warning("cost summary unavailable", error=str(exc))
            return
        line = summary_line(self.cfg.job, view["cost"], view.get("epochs_done"))
        self.log.info("job cost", job_state=state, summary=line, **{k: v for k, v in view["cost"].items()})
        self.write_event("cost", summary=line, **view["cost"])

    def _apply(self, t: Transition) -> None:
        self._state = t.new
        self.record.state = t.new.value
        self.metrics.transition(t.old, t.new)
        self.log.info("state transition", from_state=t.old.value, to_state=t.new.value, reason=t.reason)
        if t.new is NodeState.DRAINING:
            self.drain.started_at = time.time()
            self.drain.deadline = min(time.monotonic() + self.cfg.drain_timeout_s, self._deadline_from_notice())
            self.notifier.stopping(f"draining: {self.drain.reason}")
            # Before the DRAINING record is written: engines may tag it (e.g. horovod's handover
            # mode keeps the node's slots listed until the world has snapshotted).
            self._call_plugins("before_drain")
            # A leader whose engine hands its role over first (horovod: snapshot at a commit, then
            # resign) keeps it until the plug-in calls resign(); otherwise it resigns at once.
            keep = any(self._ask(p, "keeps_leadership_while_draining") for p in self.plugins)
            if self.election.is_leader and not keep:
                self.election.resign(f"draining ({self.drain.reason})")
                self._lost_leadership("draining")
        if t.new is NodeState.LEFT:
            self.resign("drained")
        self._write_event(t)
        if t.new is not NodeState.LEFT:
            self._sync_record()
        if t.new is NodeState.IDLE and t.old is NodeState.JOINING:
            self.notifier.ready(f"{t.new.value}: node {self.cfg.node_id} in job {self.cfg.job}")
        else:
            self.notifier.status(f"{t.new.value}: {t.reason}")
        self._call_plugins("on_state_change", t)

    def _sync_record(self) -> None:
        try:
            self.registration.update()
        except (UnavailableError, EtcdError) as exc:
            self.log.warning("could not write node record; will retry", error=str(exc))

    def _write_event(self, t: Transition) -> None:
        self.write_event("state", **{"from": t.old.value, "to": t.new.value, "reason": t.reason})

    def _drain_step(self) -> bool:
        done = True
        for plugin in self.plugins:
            try:
                done = bool(plugin.on_drain(self, self.drain.deadline)) and done
            except Exception as exc:  # noqa: BLE001 - an extension must not block the drain forever
                self.log.error("drain plug-in failed", plugin=type(plugin).__name__, error=str(exc))
        if not done and time.monotonic() >= self.drain.deadline:
            # The deadline is the notice's (less the margin) when one came, else drain_timeout_s.
            self.log.warning("drain deadline reached; leaving anyway", drain_timeout_s=self.cfg.drain_timeout_s,
                             past_deadline_s=round(time.monotonic() - self.drain.deadline, 2))
            return True
        return done

    def _lead(self) -> None:
        was = self.election.is_leader
        nodes_cache: list[NodeRecord] | None = None

        def nodes() -> list[NodeRecord]:
            nonlocal nodes_cache
            if nodes_cache is None:
                nodes_cache = [r for r, _ in read_nodes(self.client, self.keys)]
                self.metrics.nodes.set(len(nodes_cache))
            return nodes_cache

        # The node list is read lazily: only a preemptible node deciding whether to defer needs it.
        self.election.step(nodes)
        now = self.election.is_leader
        self.metrics.leader.set(1 if now else 0)
        self.metrics.leader_term.set(self.election.term)
        if now and not was:
            self.record.leader = True
            self.write_event("leader", term=self.election.term)  # for the timeline (elasticyolo report)
            self._call_plugins("on_become_leader", self.election.term)
        elif was and not now:
            self._lost_leadership(LEASE_LAPSED if not self.registration.lease_valid() else "resigned or deposed")
        if now and time.time() - self._last_trim > 30:
            self._trim_events()

    def _leader_reachable(self, leader: Any) -> bool:
        """Our liveness connection to `leader`'s agent is open (it is alive or frozen, not dead)."""
        client = getattr(self, "liveness_client", None)
        return bool(leader.liveness) and client is not None and client.connected_to == leader.liveness

    def _lost_leadership(self, reason: str) -> None:
        self.metrics.leader.set(0)
        self.metrics.leader_term.set(0)
        self._call_plugins("on_lose_leadership", reason)

    def _trim_events(self) -> None:
        # The event log is not leased (it outlives nodes); the leader keeps the newest EVENTS_KEPT.
        self._last_trim = time.time()
        try:
            keys = list(self.client.get_prefix_leases(self.keys.events))
            if len(keys) > EVENTS_KEPT:
                cutoff = sorted(keys)[len(keys) - EVENTS_KEPT]
                self.client.call("/kv/deleterange", {"key": b64(self.keys.events), "range_end": b64(cutoff)})
        except (UnavailableError, EtcdError) as exc:
            self.log.warning("could not trim events", error=str(exc))

    # ---- startup / shutdown -------------------------------------------------------------
    def _wait_for_etcd(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        warned = False
        while True:
            try:
                # short retry window: this loop does the waiting, and honours the deadline
                # A key of our own prefix: etcd auth may limit the role to /elasticyolo/.
                self.client.call("/kv/range", {"key": b64(self.keys.prefix), "count_only": True},
                                 retry_window=min(1.0, self.cfg.startup_timeout_s))
                return
            except UnavailableError as exc:
                if time.monotonic() >= deadline or self.drain.reason is not None:
                    raise UnavailableError(f"{exc} (gave up after {self.cfg.startup_timeout_s:g}s)") from None
                if not warned and time.monotonic() > deadline - self.cfg.startup_timeout_s + 5:
                    self.log.warning("waiting for etcd", error=str(exc), timeout_s=self.cfg.startup_timeout_s)
                    warned = True
                self.notifier.status("waiting for etcd")
                self._wake.wait(min(1.0, max(0.0, deadline - time.monotonic())))

    def _submit_config_spec(self) -> None:
        spec = self.cfg.train_spec()
        if spec is None:
            return
        try:
            if submit_spec(self.client, self.keys, spec, by=f"agent {self.cfg.node_id} config"):
                self.log.info("submitted the job spec from the agent config")
        except (UnavailableError, EtcdError) as exc:
            self.log.warning("could not submit the config's job spec; continuing", error=str(exc))

    def _start_watch(self) -> None:
        relevant = (self.keys.leader, self.keys.spec, self.keys.state, self.keys.world, self.keys.nodes,
                    self.keys.launch(self.cfg.node_id))
        events, cancel = self.client.watch_prefix(self.keys.prefix)
        self._watch_cancel = cancel

        def pump() -> None:
            for ev in events:
                if ev.key.startswith(relevant):
                    self._wake.set()

        threading.Thread(target=pump, name="etcd-watch", daemon=True).start()

    def _start_liveness(self) -> None:
        try:
            self.liveness = LivenessServer(self.cfg.addr, self.cfg.heartbeat_timeout).start()
        except OSError as exc:  # e.g. addr not local: the lease alone then detects this node's peers
            self.log.warning("liveness server not started", addr=self.cfg.addr, error=str(exc))
        else:
            self.record.extra["liveness"] = self.liveness.endpoint
            # As leader: a dead agent's lease is revoked at once, a suspect published
            # (agent/dead_nodes.py).
            self.verdicts = VerdictPublisher(self.new_client(), self.keys, self.liveness,
                                             lambda: self.election.is_leader,
                                             fence=self.election.fenced_txn_compare,
                                             lease=lambda: self.registration.lease_id,
                                             node_id=self.cfg.node_id).start()
        self.record.extra["liveness_token"] = self.liveness_client.token
        self.liveness_client.start()

    def _shutdown(self) -> None:
        self.liveness_client.stop()  # says bye: a clean exit is no failure
        self._call_plugins("on_stop")
        if self._watch_cancel is not None:
            self._watch_cancel()
        if self.state is NodeState.FAILED:
            self.log.error("agent failed", reason=self._fatal)
        if self.billing.priced and self.registration.lease_id:
            try:
                self.billing.write(ended=True)  # billed up to this moment
            except (UnavailableError, EtcdError) as exc:
                self.log.warning("could not close the billing record", error=str(exc))
        try:
            revoked = self.registration.leave()
            self.log.info("left the cluster", lease_revoked=revoked, state=self.state.value)
        except (UnavailableError, EtcdError) as exc:
            self.log.warning("could not revoke the lease; it expires on its own", error=str(exc), ttl=self.cfg.ttl)
        if self.verdicts is not None:
            self.verdicts.stop()
        if self.liveness is not None:
            self.liveness.stop()
        self.client.close()
        if self.registration.keepalive_client is not self.client:
            self.registration.keepalive_client.close()

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, _frame: object) -> None:
            if self.signal_sink is not None:
                # Signal-safe: the watcher queues a notice (with its deadline) and its dispatcher
                # thread calls request_drain; the plain assignment also covers start-up.
                self.signal_sink(signum)
                if self.drain.reason is None:
                    self.drain.reason = signal.Signals(signum).name
                return
            self.request_drain(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def _call_plugins(self, name: str, *args: Any) -> None:
        for plugin in self.plugins:
            self._ask(plugin, name, *args)

    def _ask(self, plugin: AgentPlugin, name: str, *args: Any) -> Any:
        try:
            return getattr(plugin, name)(self, *args)
        except Exception as exc:  # noqa: BLE001 - extensions must not kill the daemon
            self.log.error("plug-in failed", plugin=type(plugin).__name__, method=name, error=str(exc))
            return None
