"""The engine interface: what a training engine provides so the agents can run it.

An engine (Horovod Elastic, torch elastic, or a third one registered in `registry.py`) is one
object, an instance of a subclass of `Engine`. Its parts:

Required (a plug-in without one is refused when registered, `registry.py`):
* `name` - the spec's `engine=` value.
* `commit_target_s` - **how often it commits**: every engine commits through
  `worker_runtime/commit.py` (`EngineCommit.save()`, the node-local snapshot, the store checkpoint,
  `EngineCommit.check()`), about every `commit_target_s` seconds of work unless the spec fixes
  `commit_every`. This is the one place an engine's default interval is written.
* `worker_modules` - the modules its worker entry imports, which the warm pool's zygote
  (`worker_runtime/zygote.py`) imports once before forking warm workers (may be empty).
* `node(agent)` - its **agent-side** plug-in (`engines/node.py`, an `AgentPlugin`): runs the
  engine's share of the job on one node (worker processes; on the leader whatever coordinates
  them) and exposes the effects the drain executor needs. No torch: the agent imports it.
* `worker_main(spec, options)` - its **worker entry point**: `elasticyolo worker` looks the
  spec's engine up and calls this in a fresh process (torch is imported here, not before);
  usually a `worker_runtime.runner.WorkerRunner` with the engine's `WorkerWorld`.

Optional (the defaults here):
* `plan_drain(situation)` - its **drain planner**: a pure function choosing how a node leaves the
  world (`engines/drain.py` runs the plan). Default: stop the node's workers (`plan_stop`).
* `requires` - the modules its workers import that a node may lack (an optional install), and
  `install_hint`, what the operator installs to get them. An agent whose node lacks one refuses
  the engine's jobs with one line in `status` (`engines/installed.py`). Default: none.
* `cluster` - what runs its jobs: `"agents"` (the default: `elasticyolo submit` stores the spec in
  etcd and every agent runs `node(agent)`), or another cluster manager that takes the agents'
  place (`"ray"`: `elasticyolo ray submit`, `engines/ray/`). `elasticyolo submit` refuses an engine
  that the agents do not run, and its `node()` refuses with the same line on an agent.

The agent looks a job's engine up once per submission (`engines/dispatch.py`); nothing else
branches on the engine's name.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elasticyolo.worker_runtime.options import WorkerOptions as WorkerOptions  # part of the engine interface

if TYPE_CHECKING:
    from elasticyolo.agent.plugin import AgentPlugin, NodeAPI
    from elasticyolo.spec import TrainSpec



class DrainMode(str, enum.Enum):
    STOP = "stop"  # stop this node's workers (the engine re-forms the world on its own)
    LEAVE = "leave"  # the world removes this node at a commit; its worker exits by itself
    HANDOVER = "handover"  # the world quiesces at a commit (snapshot, maybe checkpoint) first


@dataclass(frozen=True)
class Quiesce:
    """What a HANDOVER asks of the world (the `quiesce` record, keys.py)."""

    checkpoint: bool  # also write a store checkpoint (the last node of the job is leaving)
    hold: bool  # the workers wait to be stopped: this node runs the coordinator, which stops first
    term: int | None  # the coordinator term the request is meant for (None: any)


@dataclass(frozen=True)
class DrainPlan:
    mode: DrainMode
    last_node: bool = False
    quiesce: Quiesce | None = None
    # STOP: the survivors go on without a restart and report the steps they lost in their resume
    # record (the torch engine: a stopped worker leaves at its next commit), so the drain reads it.
    survivors_report: bool = False

    @property
    def reads_resume(self) -> bool:
        """After its workers are gone, the drain waits for the survivors' resume record."""
        return self.mode is DrainMode.LEAVE or self.survivors_report

    @property
    def holds_leadership(self) -> bool:
        """The node keeps leading until its world has quiesced (then it resigns itself)."""
        return self.quiesce is not None and self.quiesce.hold


STOP = DrainPlan(DrainMode.STOP)


@dataclass(frozen=True)
class DrainSituation:
    """What a planner sees when a drain starts (gathered by the node plug-in)."""

    has_work: bool  # this node runs workers or the engine's coordinator for the job
    runs_coordinator: bool = False  # e.g. Horovod's driver, on the leader
    coordinator_term: int | None = None
    other_slots: int = 0  # slots the other serving nodes offer
    needed_slots: int = 0  # slots the job needs (min_nodes x slots)


def plan_stop(situation: DrainSituation) -> DrainPlan:
    """The planner of engines that restart their world on any change: stop the workers."""
    return STOP


class Engine(abc.ABC):
    """The engine interface (see the module's docstring for each part)."""

    # Required.
    name: str
    commit_target_s: float  # seconds of work between commits, unless the spec fixes `commit_every`
    worker_modules: tuple[str, ...]  # what its workers import: the warm pool's zygote imports them once

    @abc.abstractmethod
    def node(self, agent: "NodeAPI") -> "AgentPlugin":
        """Usually an `engines.node.EngineNode` (which runs the shared drain)."""

    @abc.abstractmethod
    def worker_main(self, spec: "TrainSpec", options: WorkerOptions) -> int: ...

    # Optional.
    requires: tuple[str, ...] = ()  # modules a node must be able to import to run its workers
    install_hint: str = ""  # what installs them, shown when a node lacks one
    cluster: str = "agents"  # what runs its jobs: the agents, or a cluster manager in their place ("ray")

    def plan_drain(self, situation: DrainSituation) -> DrainPlan:
        return plan_stop(situation)


REQUIRED_PARTS = ("name", "commit_target_s", "worker_modules", "node", "worker_main")


def missing_parts(engine: Any) -> list[str]:
    """The required parts `engine` lacks ([] for a complete `Engine`)."""
    abstract = getattr(type(engine), "__abstractmethods__", frozenset())
    return [part for part in REQUIRED_PARTS if part in abstract or not hasattr(engine, part)]
