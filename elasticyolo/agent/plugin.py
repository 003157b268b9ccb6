"""Extension points of the agent. Later pieces plug in here without touching the loop:

* the Horovod elastic driver runs on the leader: `on_become_leader` / `on_lose_leadership`;
* the worker launcher starts/stops workers: `on_job_change`, `on_state_change`, `on_drain`;
* spot-notice pollers call `agent.request_drain(reason, notice=...)` from their own thread.

Every hook runs on the agent's loop thread; a hook that raises is logged and ignored (the daemon
must not die because an extension failed). Hooks must not block for long: start a thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticyolo.agent.state import Transition

if TYPE_CHECKING:
    from elasticyolo.agent.daemon import Agent, JobView


class AgentHooks:
    """Subclass and override what you need; pass instances to `Agent(hooks=[...])` or `agent.add_hooks()`."""

    def on_start(self, agent: "Agent") -> None:
        """The agent connected to etcd, before it registers."""

    def on_state_change(self, agent: "Agent", transition: Transition) -> None:
        """After a transition was decided, logged and written to etcd."""

    def on_become_leader(self, agent: "Agent", term: int) -> None:
        """This node now leads; `term` is the fencing token (see `agent.election.fenced_put`)."""

    def on_lose_leadership(self, agent: "Agent", reason: str) -> None:
        """This node no longer leads (resigned, lease trouble, or the key changed)."""

    def on_job_change(self, agent: "Agent", job: "JobView") -> None:
        """The stored spec or job state changed (submitted, replaced, cancelled, removed)."""

    def on_drain(self, agent: "Agent", deadline: float) -> bool:
        """Called every loop iteration while DRAINING until it returns True (done) or the
        monotonic `deadline` passes. Stop workers / leave the world here."""
        return True

    def before_drain(self, agent: "Agent") -> None:
        """The node is about to be written DRAINING (runs before the record and any resign)."""

    def keeps_leadership_while_draining(self, agent: "Agent") -> bool:
        """True: this hook hands the leader role over itself during on_drain (then calls
        `agent.resign()`); the agent does not resign when it starts draining."""
        return False

    def on_tick(self, agent: "Agent") -> None:
        """Every loop iteration (about ttl/4, sooner when etcd changes)."""

    def on_stop(self, agent: "Agent") -> None:
        """Last call, after LEFT/FAILED, before the lease is revoked."""
