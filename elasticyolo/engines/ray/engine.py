"""`engine=ray`: the torch engine's workers on a Ray cluster, which takes the place of the agents
and etcd. Torch-free and Ray-free at import (the registry and `status` load it).

A job is one controller actor (`controller.py`) and one training actor per slot (`worker.py`);
`elasticyolo ray submit` or `elasticyolo.engines.ray.submit()` starts it (`job.py`). The agents do
not run it: `node()` refuses with the one line that says where it runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

from elasticyolo.engines.base import Engine, WorkerOptions
from elasticyolo.errors import UserError

if TYPE_CHECKING:
    from elasticyolo.agent.plugin import NodeAPI
    from elasticyolo.spec import TrainSpec

WHERE = "engine=ray runs on a Ray cluster, not on the agents: start it with `elasticyolo ray submit`"


class RayEngine(Engine):
    name = "ray"
    cluster = "ray"
    commit_target_s = 2.0
    worker_modules = ("elasticyolo.engines.ray.worker",)
    requires = ("ray",)
    install_hint = "pip install 'elasticyolo[ray]'"

    def node(self, agent: "NodeAPI") -> NoReturn:
        raise UserError(WHERE)

    def worker_main(self, spec: "TrainSpec", options: WorkerOptions) -> NoReturn:
        raise UserError(WHERE + " (its workers are Ray actors)")


ENGINE = RayEngine()
