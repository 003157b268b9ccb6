"""`engine=torch`: torch elastic on an etcd v3 rendezvous, run by the agents. Torch-free at import:
the agent loads this; `worker_main` imports torch.

Agent side: `node.py` (one `launcher.py` process per node: torch's `LocalElasticAgent`, the
`rendezvous.py` backend). Drain planner: stop (torch elastic restarts the world on any change and
the survivors restore the newest node-local snapshot). Worker: `worker.py`. A commit: snapshot
(every node, every commit) and checkpoint, about every 2 s of work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elasticyolo.engines.base import DrainPlan, DrainSituation, WorkerOptions, plan_stop
from elasticyolo.errors import UserError

if TYPE_CHECKING:
    from elasticyolo.agent.plugin import NodeAPI
    from elasticyolo.engines.torch.node import TorchNode
    from elasticyolo.spec import TrainSpec


class TorchEngine:
    name = "torch"
    commit_target_s = 2.0

    def node(self, agent: "NodeAPI") -> "TorchNode":
        from elasticyolo.engines.torch.node import TorchNode

        return TorchNode(self, agent)

    def plan_drain(self, situation: DrainSituation) -> DrainPlan:
        return plan_stop(situation)

    def worker_main(self, spec: "TrainSpec", options: WorkerOptions) -> int:
        from elasticyolo.engines.progress import worker_sinks
        from elasticyolo.engines.torch.worker import main

        if options.prewarm_slot is not None:
            raise UserError("engine=torch workers are not pre-warmed (--prewarm-slot is for engine=horovod)")
        sinks, progress = worker_sinks(options)
        return main(spec, sinks=sinks, progress=progress, commit_target_s=self.commit_target_s)


ENGINE = TorchEngine()
