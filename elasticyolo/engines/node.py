"""The agent side of an engine: an `AgentPlugin` that runs the engine's share of one job on this
node, created by `engines/dispatch.py` for the job's engine (so it never checks `spec.engine`).

Subclasses start and stop their processes from the callbacks (`on_tick` sees every loop
iteration) and provide the drain effects; the drain itself (plan, decide, execute) is shared:
`before_drain` asks the engine's planner for a plan and `on_drain` steps a `DrainExecutor`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticyolo.agent.plugin import AgentPlugin, NodeAPI
from elasticyolo.cluster.etcd import EtcdError
from elasticyolo.engines.base import STOP, DrainMode, DrainPlan, DrainSituation
from elasticyolo.engines.drain import DrainExecutor
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger

if TYPE_CHECKING:
    from elasticyolo.engines.base import Engine

log = get_logger("elasticyolo.engine")


class EngineNode(AgentPlugin):
    def __init__(self, engine: "Engine", agent: NodeAPI) -> None:
        self.engine = engine
        self.agent = agent
        self.drain: DrainExecutor | None = None

    # ---- what subclasses provide --------------------------------------------------------------
    def running_workers(self) -> int:
        raise NotImplementedError

    def stop_workers(self, reason: str) -> None:
        """Idempotent; called every iteration while any run: SIGTERM, SIGKILL after a grace."""
        raise NotImplementedError

    def release(self, reason: str) -> None:
        """Stop this node's coordinator (e.g. Horovod's driver on the leader), if any."""

    def drain_situation(self, agent: NodeAPI) -> DrainSituation:
        """What the planner needs to know (may read etcd; an error falls back to a plain stop)."""
        return DrainSituation(has_work=self.running_workers() > 0)

    # ---- the drain (shared) -----------------------------------------------------------------
    @property
    def drain_mode(self) -> DrainMode | None:
        return self.drain.plan.mode if self.drain is not None else None

    def before_drain(self, agent: NodeAPI) -> None:
        plan: DrainPlan
        try:
            plan = self.engine.plan_drain(self.drain_situation(agent))
        except (UnavailableError, EtcdError) as exc:
            log.warning("could not plan the drain; leaving through a plain stop", error=str(exc))
            plan = STOP
        self.drain = DrainExecutor(agent, plan, self)
        try:
            self.drain.start()
        except (UnavailableError, EtcdError) as exc:
            log.warning("drain start incomplete; continuing", error=str(exc))

    def keeps_leadership_while_draining(self, agent: NodeAPI) -> bool:
        return self.drain is not None and self.drain.plan.holds_leadership

    def on_drain(self, agent: NodeAPI, deadline: float) -> bool:
        if self.drain is None:  # draining started before this engine's job arrived
            self.before_drain(agent)
        assert self.drain is not None
        return self.drain.step()
