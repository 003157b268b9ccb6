"""A third engine, added through the engine protocol alone (`tests/test_engine_plugin.py`): no edit
anywhere else, registered with `ELASTICYOLO_ENGINES=tiny=tiny_engine:ENGINE`.

Every TRAINING node runs one worker process (`elasticyolo worker`, dispatched here by the spec's
`engine`): a world of one that trains the spec's real model on the shared worker runner
(`worker_runtime/runner.py`), which restores the newest state (the node-local snapshot or the
store's checkpoint), commits, snapshots, checkpoints, reports progress and resumes through etcd,
and saves the final checkpoint. The engine's own part is the world: one process, no collectives.
The first worker to finish marks the job done. A drain stops the worker.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from elasticyolo.agent.plugin import NodeAPI
from elasticyolo.agent.state import NodeState
from elasticyolo.cluster.jobs import set_job_state
from elasticyolo.cluster.job_state import JobEvent
from elasticyolo.cluster.settings import EtcdSettings
from elasticyolo.engines.base import Engine, WorkerOptions
from elasticyolo.engines.node import EngineNode
from elasticyolo.worker_runtime.spawn import KILL_GRACE_S, SupervisedProcess, worker_command
from elasticyolo.worker_runtime.worker_env import WorkerEnv, node_work_dir


class TinyNode(EngineNode):
    def __init__(self, engine: Any, agent: NodeAPI) -> None:
        super().__init__(engine, agent)
        self.proc: SupervisedProcess | None = None
        self.generation: int | None = None
        self.finished: set[int] = set()

    def on_tick(self, agent: NodeAPI) -> None:
        job = agent.job
        if self.proc is not None and not self.proc.running:
            if self.proc.returncode == 0 and self.generation is not None:
                self.finished.add(self.generation)
                set_job_state(agent.client, agent.keys, JobEvent.FINISH, generation=self.generation,
                              by="tiny engine")
            self.proc = None
        if agent.state is not NodeState.TRAINING or not job.active or job.spec is None:
            if self.proc is not None:
                self.stop_workers("job inactive")
            return
        if self.proc is None and job.generation not in self.finished:
            cfg = agent.cfg
            work_dir = node_work_dir(cfg.work_dir, cfg.job, cfg.node_id, job.generation)
            env = WorkerEnv(etcd=EtcdSettings.from_config(cfg), job=cfg.job, node_id=cfg.node_id,
                            spec_json=job.spec.to_json(), generation=job.generation, worker_dir=str(work_dir))
            self.generation = job.generation
            self.proc = SupervisedProcess(worker_command(), dict(os.environ), env, name="tiny-worker",
                                          on_exit=agent.wake, cwd=work_dir)

    def running_workers(self) -> int:
        return int(self.proc is not None and self.proc.running)

    def stop_workers(self, reason: str) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        if self.proc.stop_requested_at is not None and time.monotonic() - self.proc.stop_requested_at > KILL_GRACE_S:
            self.proc.kill()

    def on_stop(self, agent: NodeAPI) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)


class TinyEngine(Engine):
    name = "tiny"
    commit_target_s = 0.2
    worker_modules = ("elasticyolo.worker_runtime.runner",)

    def node(self, agent: NodeAPI) -> TinyNode:
        return TinyNode(self, agent)

    def worker_main(self, spec: Any, options: WorkerOptions) -> int:
        # The worker imports torch; the agent, which loads this module too, does not.
        from elasticyolo.train.collectives import Solo
        from elasticyolo.train.core import TrainCore
        from elasticyolo.worker_runtime.progress import worker_sinks
        from elasticyolo.worker_runtime.runner import WorkerRunner, WorkerWorld

        class OneProcess(WorkerWorld):
            """A world of one: nothing to form, nothing to agree on."""

            collectives = Solo()
            local_rank = 0

            def join(self, runner: WorkerRunner) -> TrainCore:
                return TrainCore(spec, work_dir=runner.env.run_dir)

        sinks, progress = worker_sinks(options)
        WorkerRunner(spec, OneProcess(), commit_target_s=self.commit_target_s, sinks=sinks, progress=progress).run()
        if progress is not None:
            progress.flush()
        return 0


ENGINE = TinyEngine()

if __name__ == "__main__":  # pragma: no cover
    sys.exit("tiny_engine is loaded through ELASTICYOLO_ENGINES")
