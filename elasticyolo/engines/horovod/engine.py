"""`engine=horovod`: Horovod Elastic driven by the leader's agent, workers started by every
node's agent (no SSH). Torch-free at import: the agent loads this; `worker_main` imports torch.

Agent side: `node.py` (launcher, pre-warmed workers, the leader's `driver.py` with etcd
`discovery.py`). Drain planner: `drain.py` (leave at a commit, or hand over after a quiesce).
Worker: `worker.py` (`hvd.elastic.run`; warm processes: `worker_runtime/prewarm.py`), `quiesce.py`.
A commit: `state.save()`, snapshot, checkpoint, then Horovod's host-update check, about every
`commit_target_s` seconds of work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from elasticyolo.engines.base import DrainPlan, DrainSituation, Engine, WorkerOptions
from elasticyolo.engines.horovod import drain

if TYPE_CHECKING:
    from elasticyolo.agent.plugin import NodeAPI
    from elasticyolo.engines.horovod.node import HorovodNode
    from elasticyolo.spec import TrainSpec


class HorovodEngine(Engine):
    name = "horovod"
    commit_target_s = 1.0
    worker_modules = ("elasticyolo.engines.horovod.worker",)
    # Horovod is an optional install (the `horovod` extra, docs/install.md): a node without it runs
    # torch jobs and refuses this engine's.
    requires = ("horovod.torch",)
    install_hint = "pip install 'elasticyolo[horovod]', see docs/install.md"

    def node(self, agent: "NodeAPI") -> "HorovodNode":
        from elasticyolo.engines.horovod.node import HorovodNode

        return HorovodNode(self, agent)

    def plan_drain(self, situation: DrainSituation) -> DrainPlan:
        return drain.plan_drain(situation)

    def worker_main(self, spec: "TrainSpec", options: WorkerOptions) -> int:
        def train(prepared: Any = None) -> int:
            from elasticyolo.engines.horovod.worker import run_worker
            from elasticyolo.worker_runtime.progress import worker_sinks

            sinks, progress = worker_sinks(options)  # after a warm worker got its environment
            run_worker(spec, sinks=sinks, prepared=prepared, progress=progress, commit_target_s=self.commit_target_s)
            return 0

        if options.prewarm_slot is not None:
            from elasticyolo.engines.horovod.worker import prepare_worker
            from elasticyolo.worker_runtime.prewarm import serve

            return serve(spec, options.prewarm_slot, train, prepare=lambda core: prepare_worker(spec, core))
        return train()


ENGINE = HorovodEngine()
