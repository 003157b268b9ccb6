"""Spot interruption notices -> drain: the glue between `elasticyolo.spot` and the agent.

`SpotDrain` is an `AgentPlugin` that owns the node's `NoticeWatcher`:
* a draining notice (terminate/stop/preempt, a file, SIGTERM) -> `agent.request_drain` with the
  notice's deadline: the agent goes DRAINING (written to etcd with the notice) and the engine
  leaves the world before `deadline - drain_margin_s`;
* an at-risk notice (a rebalance recommendation, a GCP live migration) only marks the node
  (node record `notice` with `at_risk`, metric `elasticyolo_node_at_risk`) unless
  `--drain-on-rebalance`;
* every notice, drain start and drain end goes to the job's event log in etcd and to metrics;
  the drain end carries notice-to-drained seconds and the engine's lost-step count
  (`agent.drain.report`, filled by the engine's plug-in during `on_drain`);
* once drained, notices are acknowledged (Azure approves the Preempt event).

The engine work (leaving the Horovod world at a commit boundary, handing the leader role over)
lives in the engines (`engines/drain.py` and each engine's planner); this module is
engine-neutral and imports no torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from elasticyolo.agent.plugin import AgentPlugin, NodeAPI
from elasticyolo.agent.state import NodeState, Transition
from elasticyolo.log import get_logger
from elasticyolo.spot.factory import make_watcher
from elasticyolo.spot.notice import Notice
from elasticyolo.spot.watcher import NoticeWatcher

if TYPE_CHECKING:
    from elasticyolo.config import AgentConfig

log = get_logger("elasticyolo.drain")


class SpotDrain(AgentPlugin):
    def __init__(self, watcher: NoticeWatcher, drain_on_rebalance: bool = False) -> None:
        self.watcher = watcher
        self.drain_on_rebalance = drain_on_rebalance
        self.agent: NodeAPI | None = None
        self.first_notice_at: float | None = None  # epoch s of the first draining notice
        self._drain_notices: list[Notice] = []
        self._spot_status: Any = None
        self._status_at = 0.0

    @classmethod
    def from_config(cls, cfg: "AgentConfig") -> "SpotDrain":
        watcher = make_watcher(cfg.spot_provider, cfg.metadata_url, cfg.notice_file, cfg.spot_poll_interval,
                               drain_on_rebalance=cfg.drain_on_rebalance)
        return cls(watcher, cfg.drain_on_rebalance)

    # ---- hooks ----------------------------------------------------------------------------
    def on_start(self, agent: NodeAPI) -> None:
        self.agent = agent
        self.watcher.start(self._on_notice)

    def on_state_change(self, agent: NodeAPI, transition: Transition) -> None:
        if transition.new is NodeState.DRAINING:
            reason = agent.drain.reason or "requested"
            agent.metrics.drains.labels(node=agent.cfg.node_id, job=agent.cfg.job,
                                        reason=reason.split(":")[0]).inc()
            left = agent.drain.deadline - time.monotonic()
            agent.write_event("drain_start", reason=reason, deadline_in_s=round(left, 1),
                              notice=agent.record.notice)
        elif transition.new is NodeState.LEFT and agent.drain.started_at is not None:
            self._drained(agent)

    def on_tick(self, agent: NodeAPI) -> None:
        # Watcher health in the node record (status shows a failing metadata endpoint), rarely.
        now = time.monotonic()
        if now - self._status_at < 5.0 or not self.watcher.sources:
            return
        self._status_at = now
        st = self.watcher.status()
        compact = {"provider": st["provider"],
                   "failing": sorted(n for n, h in st["sources"].items() if h.get("failures"))}
        if compact != self._spot_status:
            self._spot_status = compact
            agent.set_record_field("spot", compact)

    def on_stop(self, agent: NodeAPI) -> None:
        self.watcher.stop(timeout=1.0)

    # ---- notices (watcher dispatcher thread) ---------------------------------------------
    def _on_notice(self, n: Notice) -> None:
        agent = self.agent
        if agent is None:
            return
        drain = n.drain or (self.drain_on_rebalance and n.kind in ("rebalance", "maintenance"))
        agent.write_event("notice", provider=n.provider, notice_kind=n.kind, drain=drain, key=n.key,
                          deadline=n.deadline, seconds_left=round(n.seconds_left(), 1))
        record = n.to_record()
        if drain:
            if self.first_notice_at is None:
                self.first_notice_at = n.received_at
            self._drain_notices.append(n)
            agent.request_drain(f"spot:{n.provider}:{n.kind}", notice=record, deadline=n.deadline)
        else:
            agent.metrics.at_risk.set(1)
            agent.set_notice({**record, "at_risk": True})

    # ---- drain end --------------------------------------------------------------------------
    def _drained(self, agent: NodeAPI) -> None:
        now = time.time()
        start = self.first_notice_at or agent.drain.started_at or now
        seconds = round(now - start, 2)
        report = dict(agent.drain.report)
        lost = report.get("lost_steps")
        agent.metrics.notice_to_drained.set(seconds)
        agent.metrics.drain_lost_steps.set(-1 if lost is None else float(lost))
        acked = [n.key for n in self._drain_notices if self._ack(n)]
        agent.write_event("drain_end", reason=agent.drain.reason, notice_to_drained_s=seconds,
                          acknowledged=acked, **report)
        log.info("drained", node=agent.cfg.node_id, notice_to_drained_s=seconds, **report)

    def _ack(self, n: Notice) -> bool:
        try:
            return bool(self.watcher.acknowledge(n))
        except Exception as exc:  # noqa: BLE001 - the node goes anyway; Azure then waits out NotBefore
            log.warning("could not acknowledge notice", key=n.key, error=str(exc))
            return False
