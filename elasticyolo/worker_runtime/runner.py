"""One training worker, for every engine: the setup every engine's worker shares, run once.

`WorkerRunner.run()`:
1. the engine forms its world and hands back the training core set to it (`WorkerWorld.join`);
2. the node-local snapshots (local rank 0 writes; `train/snapshots.py`), the checkpointer (rank 0
   saves; `train/checkpointing.py`), the trace (`ELASTICYOLO_TRACE_DIR`) and rank 0's run folder;
3. the engine runs the training across its world changes (`WorkerWorld.run`), entering each world
   through `WorkerRunner.session()`: the resume trace, a commit (`worker_runtime/commit.py`) with
   the engine's part (`EngineCommit`), and the shared `TrainingLoop`;
4. the final checkpoint, the `done` trace, rank 0's run folder and its `done:` line;
5. always: the loader, the snapshot writer and the checkpoint uploader closed.

An engine supplies only a `WorkerWorld`: its collectives, its commit agreement, its world changes.
`tests/plugins/tiny_engine.py` is a whole engine on this runner in one file.
"""

from __future__ import annotations

import abc
import time
from pathlib import Path
from typing import Any

from elasticyolo.log import get_logger
from elasticyolo.spec import TrainSpec
from elasticyolo.train.checkpointing import Checkpointer
from elasticyolo.train.collectives import Collectives
from elasticyolo.train.core import TrainCore, quiet_ultralytics
from elasticyolo.train.digest import params_digest
from elasticyolo.train.loop import ProgressSink, Summary, TraceWriter, TrainingLoop
from elasticyolo.train.run_publish import ClusterRunFolder
from elasticyolo.train.snapshots import LocalSnapshots, Restored, restore_newest
from elasticyolo.worker_runtime import worker_env
from elasticyolo.worker_runtime.commit import CommitHooks, EngineCommit
from elasticyolo.worker_runtime.progress import EtcdProgress

log = get_logger("elasticyolo.worker")


class WorkerWorld(abc.ABC):
    """An engine's part of a training worker, which `WorkerRunner` calls.

    Required: `join()` (form the world, return the core set to it), `collectives` and
    `local_rank` (valid after `join`). Optional, with defaults: `run()` (the world changes:
    by default one world for the whole run, started from the newest state anywhere),
    `snapshot_period_s`, `run_root()`, `close_timeout_s`."""

    snapshot_period_s: float = 0.0  # node-local snapshots at most this often (0: every commit)
    close_timeout_s: float = 60.0  # the checkpoint uploader's last uploads, at exit

    @abc.abstractmethod
    def join(self, runner: "WorkerRunner") -> TrainCore:
        """Form the world (the collective layer's init) and return the training core, set to it."""

    @property
    @abc.abstractmethod
    def collectives(self) -> Collectives:
        """The world's object collectives (restore, commit interval, sharded validation)."""

    @property
    @abc.abstractmethod
    def local_rank(self) -> int:
        """This process's slot on its node (local rank 0 writes the node's snapshot)."""

    def run_root(self, core: TrainCore) -> Path:
        """Where rank 0's Ultralytics run folder goes (`<root>/<job>`)."""
        return Path(core.work_dir)

    def run(self, runner: "WorkerRunner") -> Summary | None:
        """Train across the engine's world changes; None: the worker leaves without a final save.
        Default: one world for the whole run (an engine that restarts its world on any change),
        started from the newest state in the world, committing with no engine part."""
        restored = runner.restore()
        runner.report_resume(restored)
        return runner.session(EngineCommit(), resume={"source": restored.source, "src_rank": restored.src_rank},
                              source=restored.source)


class WorkerRunner:
    """`sinks`: progress sinks (rank 0's); `progress`: the etcd one among them, which takes the
    resume records; `commit_target_s`: seconds of work between commits (the engine's);
    `store`: the checkpoint store opened and checked beforehand (a warm worker), else opened here."""

    def __init__(self, spec: TrainSpec, world: WorkerWorld, *, commit_target_s: float,
                 sinks: list[ProgressSink] | None = None, progress: EtcdProgress | None = None,
                 store: Any = None) -> None:
        self.spec, self.world, self.commit_target_s = spec, world, commit_target_s
        self.sinks, self.progress, self.store = list(sinks or []), progress, store
        self.started_at = time.time()
        self.env = worker_env.read()
        self.job = self.env.job or "default"
        # Set by run(), for the engine's `WorkerWorld.run`.
        self.core: TrainCore
        self.snapshots: LocalSnapshots
        self.checkpointer: Checkpointer
        self.trace: TraceWriter
        self.run_folder: ClusterRunFolder

    def run(self) -> Summary | None:
        quiet_ultralytics()
        core = self.core = self.world.join(self)
        closers: list[Any] = [core.close]
        try:
            self.snapshots = LocalSnapshots(self.env.snapshot_dir, writer=self.world.local_rank == 0,
                                            period_s=self.env.snapshot_period(self.world.snapshot_period_s))
            closers.append(self.snapshots.close)
            rank = core.rank
            self.checkpointer = Checkpointer(self.spec, self.job, rank, sinks=self.sinks if rank == 0 else None,
                                             store=self.store)
            closers.append(lambda: self.checkpointer.close(timeout=self.world.close_timeout_s))
            self.trace = TraceWriter()
            # Ultralytics' run folder on rank 0's node, published next to the checkpoints.
            self.run_folder = ClusterRunFolder(core, self.job, self.checkpointer.store, self.world.run_root(core))
            summary = self.world.run(self)
            if summary is not None:
                self.finish(summary)
            return summary
        finally:
            for close in reversed(closers):
                close()

    def restore(self) -> Restored:
        """The newest state anywhere in the world (every node's snapshot, the store's newest),
        loaded on every rank, then the core set to the world again (its rescaling policy)."""
        core = self.core
        restored = restore_newest(core, self.snapshots, self.world.collectives, self.checkpointer)
        core.set_world(core.world, core.rank)
        return restored

    def report_resume(self, restored: Restored) -> None:
        """Rank 0 records where a world that restored the newest state started from (`resume`)."""
        core = self.core
        if core.rank == 0 and self.progress is not None:
            self.progress.resume(core.progress.step, core.world, None,
                                 "restore" if restored.source != "fresh" else "start", source=restored.source)

    def session(self, commit: EngineCommit, resume: dict[str, Any] | None = None, **log_fields: Any) -> Summary:
        """Train in the current world from the core's state: the resume trace, then the loop.
        `resume`: the engine's own fields of the resume trace; `log_fields`: of the log line."""
        core, trace = self.core, self.trace
        trace.write("resume", rank=core.rank, world=core.world, step=core.progress.step, epoch=core.progress.epoch,
                    consumed=core.progress.consumed, lr_scale=core.current_lr_scale(),
                    accumulate=core.scaling.accumulate, **(resume or {}),
                    # Digests cost a pass over every tensor: only for a trace (tests, benches).
                    **({"params_digest": params_digest(core.model)} if trace.enabled else {}))
        log.info("training", rank=core.rank, world=core.world, epoch=core.progress.epoch, step=core.progress.step,
                 **log_fields)
        self.checkpointer.rank = core.rank
        self.checkpointer.sinks = list(self.sinks) if core.rank == 0 else []
        hooks = CommitHooks(core, self.world.collectives, target_s=self.commit_target_s, snapshots=self.snapshots,
                            checkpointer=self.checkpointer, engine=commit)
        loop = TrainingLoop(core, hooks=hooks, sinks=(self.sinks + self.run_folder.sinks()) if core.rank == 0 else [],
                            trace=trace)
        return loop.run()

    def finish(self, summary: Summary) -> None:
        """The end of training: the final checkpoint, the trace, rank 0's run folder and `done:` line."""
        core = self.core
        if not self.checkpointer.save_now(core, reason="final"):
            log.warning("final_checkpoint_late", step=core.progress.step)
        self.trace.write("done", rank=core.rank, world=core.world, step=core.progress.step)
        if core.rank == 0:
            self.run_folder.finish()
            m = summary.metrics
            print(f"done: epochs={summary.epochs} steps={summary.steps} world={core.world} "
                  f"mAP50={m.get('mAP50', 0.0):.3f} mAP50-95={m.get('mAP50-95', 0.0):.3f} "
                  f"seconds={summary.seconds:.1f}", flush=True)
