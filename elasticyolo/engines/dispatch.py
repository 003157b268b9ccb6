"""The agent plug-in that runs the job's engine: looks the engine up once (the spec's `engine`,
through `registry.py`), creates its node plug-in and forwards every callback to it. A resubmission
naming another engine stops the old plug-in (its workers) and starts the new one; a resubmission
with the same engine is the node plug-in's business (`JobView.generation` changes).

An engine this node cannot run (not installed here, `installed.py`; or one that will not load) is
refused: no workers, and the one-line reason in this node's record (`installed.RECORD_FIELD`),
which `elasticyolo status` shows, until the job names an engine the node runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticyolo.agent.plugin import AgentPlugin, NodeAPI
from elasticyolo.engines import registry
from elasticyolo.engines.installed import RECORD_FIELD as REFUSED_FIELD, engine_refusal
from elasticyolo.errors import UserError
from elasticyolo.log import get_logger

if TYPE_CHECKING:
    from elasticyolo.agent.job import JobView
    from elasticyolo.agent.state import Transition
    from elasticyolo.engines.base import Engine

log = get_logger("elasticyolo.engines")


class EngineDispatch(AgentPlugin):
    def __init__(self) -> None:
        self.current: AgentPlugin | None = None
        self.engine_name: str | None = None
        self._failed: str | None = None  # the engine this node refused (logged once)

    def _select(self, agent: NodeAPI) -> AgentPlugin | None:
        spec = agent.job.spec
        if spec is None and self._failed is not None:  # the refused job was removed
            self._failed = None
            agent.set_record_field(REFUSED_FIELD, None)
        name = spec.engine if spec is not None else self.engine_name
        if name is None or name == self.engine_name or name == self._failed:
            return self.current
        if self.current is not None:
            log.info("job engine changed; stopping the old one", old=self.engine_name, new=name)
            self._forward(agent, "on_stop")
        try:
            engine: Engine = registry.get(name)
            refused = engine_refusal(engine)
            if refused is not None:
                raise UserError(refused)
            node = engine.node(agent)
        except UserError as exc:
            log.error("engine unavailable on this node", engine=name, error=str(exc))
            self.current, self.engine_name, self._failed = None, None, name
            agent.set_record_field(REFUSED_FIELD, str(exc))
            return None
        self.current, self.engine_name, self._failed = node, name, None
        agent.set_record_field(REFUSED_FIELD, None)
        log.info("engine selected", engine=name)
        self._forward(agent, "on_start")
        return node

    def _forward(self, agent: NodeAPI, method: str, *args: object) -> object:
        if self.current is None:
            return None
        try:
            return getattr(self.current, method)(agent, *args)
        except Exception as exc:  # noqa: BLE001 - one engine's failure must not stop the others' calls
            log.error("engine plug-in failed", engine=self.engine_name, method=method, error=str(exc))
            return None

    # ---- AgentPlugin -----------------------------------------------------------------------------
    def on_start(self, agent: NodeAPI) -> None:
        self._select(agent)

    def on_job_change(self, agent: NodeAPI, job: "JobView") -> None:
        self._select(agent)
        self._forward(agent, "on_job_change", job)

    def on_state_change(self, agent: NodeAPI, transition: "Transition") -> None:
        self._forward(agent, "on_state_change", transition)

    def on_become_leader(self, agent: NodeAPI, term: int) -> None:
        self._forward(agent, "on_become_leader", term)

    def on_lose_leadership(self, agent: NodeAPI, reason: str) -> None:
        self._forward(agent, "on_lose_leadership", reason)

    def before_drain(self, agent: NodeAPI) -> None:
        self._forward(agent, "before_drain")

    def keeps_leadership_while_draining(self, agent: NodeAPI) -> bool:
        return bool(self._forward(agent, "keeps_leadership_while_draining"))

    def on_drain(self, agent: NodeAPI, deadline: float) -> bool:
        if self.current is None:
            return True
        return bool(self.current.on_drain(agent, deadline))  # the agent logs a failure and goes on

    def on_tick(self, agent: NodeAPI) -> None:
        self._forward(agent, "on_tick")

    def on_stop(self, agent: NodeAPI) -> None:
        self._forward(agent, "on_stop")
