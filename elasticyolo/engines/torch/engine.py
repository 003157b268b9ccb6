"""`engine=torch`: torch.distributed, re-formed in place on every world change, run by the agents.
Torch-free at import: the agent loads this; `worker_main` imports torch.

Agent side: `node.py` (one `launcher.py` process per node keeps its slots' workers; the leader's
`coordinator.py` publishes each world, decided by `world_plan.py`). Drain planner: stop (the
leaving worker asks to leave and exits at the next commit; the survivors keep their processes
and their state, and report the steps lost, none, in their resume record). Worker: `worker.py`, started warm (`worker_runtime/prewarm.py`). A
commit: the state kept in memory (the rollback point), a node-local snapshot at most every 10 s
(a full restart's state) and the checkpoint when due, about every `commit_target_s` seconds of work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elasticyolo.engines.base import DrainMode, DrainPlan, DrainSituation, Engine, WorkerOptions

if TYPE_CHECKING:
    from elasticyolo.agent.plugin import NodeAPI
    from elasticyolo.engines.torch.node import TorchNode
    from elasticyolo.spec import TrainSpec


class TorchEngine(Engine):
    name = "torch"
    commit_target_s = 2.0
    worker_modules = ("elasticyolo.engines.torch.worker", "elasticyolo.worker_runtime.progress")

    def plan_drain(self, situation: DrainSituation) -> DrainPlan:
        """Stop: the worker asks to leave and exits at the next commit. Where the others can train
        on without this node, they resume at once and their resume record gives the lost steps."""
        last = situation.other_slots < max(situation.needed_slots, 1)
        return DrainPlan(DrainMode.STOP, last_node=last, survivors_report=not last)

    def node(self, agent: "NodeAPI") -> "TorchNode":
        from elasticyolo.engines.torch.node import TorchNode

        return TorchNode(self, agent)

    def worker_main(self, spec: "TrainSpec", options: WorkerOptions) -> int:
        def train(prepared: Any = None) -> int:
            from elasticyolo.engines.torch.worker import main
            from elasticyolo.worker_runtime.progress import worker_sinks

            sinks, progress = worker_sinks(options)  # after a warm worker got its environment
            return main(spec, sinks=sinks, progress=progress, commit_target_s=self.commit_target_s,
                        prepared=prepared)

        if options.prewarm_slot is not None:
            from elasticyolo.worker_runtime import worker_env
            from elasticyolo.worker_runtime.prewarm import serve

            return serve(spec, options.prewarm_slot, train, work_dir=worker_env.read().run_dir,
                         prepare=lambda core: _prepare(spec, core))
        return train()


def _prepare(spec: "TrainSpec", core: Any) -> Any:
    """A warm worker's work before its round: the worker module's imports (~0.5 s on 2 cores) and
    the checked checkpoint store (boto3 client and a write check), which a round that has formed
    would otherwise wait for."""
    import elasticyolo.worker_runtime.progress  # noqa: F401
    from elasticyolo.engines.torch.worker import prepare_worker

    return prepare_worker(spec, core)


ENGINE = TorchEngine()
