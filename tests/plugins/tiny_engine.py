"""A third engine, added through the engine protocol alone (`tests/test_engine_plugin.py`): no edit
anywhere else, registered with `ELASTICYOLO_ENGINES=tiny=tiny_engine:ENGINE`.

Every TRAINING node runs one worker process (`elasticyolo worker`, dispatched here by the spec's
`engine`). The worker "trains" by counting steps (no torch: the point is the plumbing), commits a
node-local state file every `commit_every` steps, reports progress, each commit as the last
checkpoint and its (re)start through the engine-neutral etcd reporter, and resumes from its state
file. The first worker to finish every epoch marks the job done. A drain stops the worker.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from elasticyolo.agent.plugin import NodeAPI
from elasticyolo.agent.state import NodeState
from elasticyolo.cluster.jobs import set_job_state
from elasticyolo.cluster.job_state import JobEvent
from elasticyolo.cluster.settings import EtcdSettings
from elasticyolo.engines.base import DrainPlan, DrainSituation, WorkerOptions, plan_stop
from elasticyolo.engines.node import EngineNode
from elasticyolo.worker_runtime import worker_env
from elasticyolo.worker_runtime.progress import worker_sinks
from elasticyolo.worker_runtime.spawn import KILL_GRACE_S, SupervisedProcess, worker_command
from elasticyolo.worker_runtime.worker_env import WorkerEnv, node_work_dir

STEPS_PER_EPOCH = 5
STEP_S = 0.05
STATE_FILE = "tiny-state.json"


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


class TinyEngine:
    name = "tiny"
    commit_target_s = 0.2

    def node(self, agent: NodeAPI) -> TinyNode:
        return TinyNode(self, agent)

    def plan_drain(self, situation: DrainSituation) -> DrainPlan:
        return plan_stop(situation)

    def worker_main(self, spec: Any, options: WorkerOptions) -> int:
        env = worker_env.read()
        sinks, progress = worker_sinks(options)
        path = Path(env.worker_dir or ".") / STATE_FILE
        step = json.loads(path.read_text())["step"] if path.exists() else 0
        stopping: list[int] = []
        signal.signal(signal.SIGTERM, lambda signum, _frame: stopping.append(signum))
        if progress is not None:
            progress.resume(step, 1, None, "restore" if step else "start")
        every = spec.commit_every or max(1, round(self.commit_target_s / STEP_S))
        total = spec.epochs * STEPS_PER_EPOCH
        print(json.dumps({"event": "tiny worker started", "level": "info", "step": step, "pid": os.getpid()}),
              flush=True)
        while step < total and not stopping:
            time.sleep(STEP_S)  # one "training" step takes this long
            step += 1
            rec = {"kind": "step", "epoch": step // STEPS_PER_EPOCH, "epochs": spec.epochs, "step": step,
                   "consumed": step % STEPS_PER_EPOCH, "num_samples": STEPS_PER_EPOCH, "world_size": 1,
                   "loss": 1.0 / step, "lr": 0.01, "samples_per_s": spec.batch / STEP_S}
            for sink in sinks:
                sink(rec)
            if step % every == 0 or step == total:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"step": step}))
                os.replace(tmp, path)
                for sink in sinks:
                    sink({"kind": "checkpoint", "uri": path.as_uri(), "epoch": step // STEPS_PER_EPOCH,
                          "step": step, "at": time.time()})
        if progress is not None:
            progress.flush()
        return 143 if stopping else 0


ENGINE = TinyEngine()

if __name__ == "__main__":  # pragma: no cover
    sys.exit("tiny_engine is loaded through ELASTICYOLO_ENGINES")
