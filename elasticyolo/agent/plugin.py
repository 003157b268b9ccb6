"""The agent's plug-in API: what a plug-in is told (`AgentPlugin` callbacks) and what it may use
(`NodeAPI`, implemented by `agent.daemon.Agent`). Engines (`engines/`), the spot-notice drain
(`agent/drain.py`) and later pieces (liveness, trace replay) plug in here without touching the loop.

* Callbacks run on the agent's loop thread; one that raises is logged and ignored (the daemon
  must not die because an extension failed). They must not block for long: start a thread.
* Plug-ins never write the agent's fields: they change the node record with
  `set_record_field`, give leadership up with `resign`, report a drain with `drain.report`,
  log to the job's event log with `write_event`. `request_drain`, `set_notice` and `wake` are
  thread-safe (signal handlers and pollers call them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from elasticyolo.agent.job import JobView
    from elasticyolo.agent.metrics import AgentMetrics
    from elasticyolo.agent.state import NodeState, Transition
    from elasticyolo.cluster.election import LeaderElection
    from elasticyolo.cluster.etcd import EtcdClient
    from elasticyolo.cluster.keys import JobKeys
    from elasticyolo.cluster.liveness import LivenessServer
    from elasticyolo.cluster.registry import NodeRecord
    from elasticyolo.config import AgentConfig


# The reason plug-ins get (`on_lose_leadership`) when leadership went with a lapsed lease: the node
# may take it back (cluster/election.py), so an engine may keep its coordinator meanwhile.
LEASE_LAPSED = "lease lapsed"


class DrainInfo(Protocol):
    """The drain in progress (meaningful while DRAINING)."""

    reason: str | None
    started_at: float | None  # epoch s
    deadline: float  # monotonic s by which the drain must be done
    report: dict[str, Any]  # engine findings (mode, lost_steps, ...), logged with the drain_end event


class NodeAPI(Protocol):
    """The agent as plug-ins see it."""

    cfg: "AgentConfig"
    keys: "JobKeys"
    client: "EtcdClient"  # the agent's own client (used on the loop thread)
    election: "LeaderElection"  # term, fenced_put / fenced_txn_compare for leader-side writes
    metrics: "AgentMetrics"
    record: "NodeRecord"  # this node's record as last written; read-only (see set_record_field)
    drain: DrainInfo
    liveness: "LivenessServer | None"  # this agent's liveness server (the leader's judges the others)

    @property
    def state(self) -> "NodeState": ...
    @property
    def job(self) -> "JobView": ...
    @property
    def is_leader(self) -> bool: ...
    def lease_id(self) -> int: ...  # the node lease (0 while not registered); callable from any thread
    def new_client(self, timeout: float | None = None) -> "EtcdClient": ...  # for a plug-in's own threads
    def wake(self) -> None: ...
    def set_record_field(self, name: str, value: Any) -> None: ...  # node record extra field; None removes
    def set_notice(self, notice: dict[str, Any]) -> None: ...
    def request_drain(self, reason: str, notice: dict[str, Any] | None = None,
                      deadline: float | None = None) -> None: ...
    def resign(self, reason: str) -> None: ...
    def write_event(self, kind: str, **fields: Any) -> None: ...


class AgentPlugin:
    """Subclass and override what you need; pass instances to `Agent(plugins=[...])`."""

    def on_start(self, agent: NodeAPI) -> None:
        """The agent connected to etcd, before it registers."""

    def on_state_change(self, agent: NodeAPI, transition: "Transition") -> None:
        """After a transition was decided, logged and written to etcd."""

    def on_become_leader(self, agent: NodeAPI, term: int) -> None:
        """This node now leads; `term` is the fencing token (see `agent.election.fenced_put`)."""

    def on_lose_leadership(self, agent: NodeAPI, reason: str) -> None:
        """This node no longer leads (resigned, lease trouble, or the key changed)."""

    def on_job_change(self, agent: NodeAPI, job: "JobView") -> None:
        """The stored spec or job state changed (submitted, replaced, cancelled, removed)."""

    def before_drain(self, agent: NodeAPI) -> None:
        """The node is about to be written DRAINING (runs before the record and any resign)."""

    def keeps_leadership_while_draining(self, agent: NodeAPI) -> bool:
        """True: this plug-in hands the leader role over itself during on_drain (then calls
        `agent.resign()`); the agent does not resign when it starts draining."""
        return False

    def on_drain(self, agent: NodeAPI, deadline: float) -> bool:
        """Called every loop iteration while DRAINING until it returns True (done) or the
        monotonic `deadline` passes. Stop workers / leave the world here."""
        return True

    def on_tick(self, agent: NodeAPI) -> None:
        """Every loop iteration (about ttl/4, sooner when etcd changes)."""

    def on_stop(self, agent: NodeAPI) -> None:
        """Last call, after LEFT/FAILED, before the lease is revoked."""

