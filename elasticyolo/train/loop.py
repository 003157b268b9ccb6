"""The training loop shared by every engine: steps, epoch ends, validation, commits, reporting.

Engines differ only in what a commit is (Horovod: `state.commit()`; single process: nothing) and
in how rank/world are obtained; they pass those in as hooks.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from elasticyolo.train import sim_accelerator
from elasticyolo.train.checkpointing import Checkpointer, saves_checkpoints
from elasticyolo.train.core import StepResult, TrainCore
from elasticyolo.train.fitness import should_stop

ProgressSink = Callable[[dict[str, Any]], None]


class Hooks:
    """What the loop asks of the world it trains in. Every part has a default: no commits, no
    extra commit points, one rank validates all."""

    def commit(self) -> None:
        """Make the state at this step the world's committed state."""
        return None

    def commit_every(self, core: TrainCore) -> int:
        """Steps until the next commit (0: only at epoch ends and at the end); asked after each."""
        return 0

    def commit_now(self) -> bool:
        """Asked after every step: the world agreed to commit at this step as well (the same
        answer on every rank)."""
        return False

    # An all-gather of a Python object across the world, for sharded validation
    # (`TrainCore.validate`); None: one rank validates all.
    gather: Callable[[Any], list[Any]] | None = None


class NoCommit(Hooks):
    """Training without commits."""


class LocalHooks(Hooks):
    """Single-process training: a commit is just a checkpoint opportunity."""

    def __init__(self, core: TrainCore, checkpointer: Checkpointer) -> None:
        self.core, self.checkpointer = core, checkpointer

    def commit(self) -> None:
        self.checkpointer.after_commit(self.core)

    def commit_every(self, core: TrainCore) -> int:
        return 1 if self.checkpointer.enabled else 0


class TraceWriter:
    """Append-only JSONL record of what each rank trained (indices per step, commits, resets).
    Tests and benchmarks read it to prove exactly-once sample coverage and to time recovery.
    Enabled by `ELASTICYOLO_TRACE_DIR`."""

    def __init__(self, directory: str | None = None) -> None:
        directory = directory or os.environ.get("ELASTICYOLO_TRACE_DIR")
        self._fh = None
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._fh = open(Path(directory) / f"trace-{os.getpid()}.jsonl", "a", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._fh is not None

    def write(self, event: str, **fields: Any) -> None:
        if self._fh is not None:
            self._fh.write(json.dumps({"ev": event, "t": time.time(), "pid": os.getpid(), **fields}) + "\n")


@dataclass
class Summary:
    epochs: int
    steps: int
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    images: int = 0


class TrainingLoop:
    def __init__(
        self,
        core: TrainCore,
        *,
        hooks: Hooks | None = None,
        sinks: list[ProgressSink] | None = None,
        trace: TraceWriter | None = None,
        validate_every_epoch: bool = True,
    ) -> None:
        self.core = core
        self.hooks = hooks or NoCommit()
        self.sinks = sinks or []
        self.trace = trace or TraceWriter()
        self.validate_every_epoch = validate_every_epoch
        self._images = 0
        self._window: list[StepResult] = []
        self._epoch_loss: dict[str, float] = {}  # loss components summed over this epoch's micro-batches
        self._epoch_micro = 0
        self.last_metrics: dict[str, float] = {}
        if self.trace.enabled:
            core.loader.on_replan = self._trace_replan

    def _trace_replan(self, stream: str, old: Any, new: Any, dropped: int) -> None:
        """The loader restarted its plan (a reset, rollback, resize or restore): `dropped`
        prefetched batches of the old plan were discarded unused."""
        if stream == "train":
            self.trace.write("replan", rank=self.core.rank, world=self.core.world, old=old, new=new,
                             dropped=dropped)

    def _emit(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink(record)

    def _throughput(self, result: StepResult) -> float:
        """Global samples/s over the last few steps (this rank's rate times the world)."""
        self._window = (self._window + [result])[-10:]
        secs = sum(r.seconds for r in self._window)
        imgs = sum(r.images for r in self._window)
        return imgs * self.core.world / secs if secs > 0 else 0.0

    def run(self) -> Summary:
        core = self.core
        # Another rank starting the uploader's fork server would import torch on its host for
        # nothing, on every torch elastic round.
        sim_accelerator.enter(helpers=core.loader.workers > 0
                              or (bool(core.spec.checkpoint) and saves_checkpoints(core.rank)))
        t0 = time.perf_counter()
        self.trace.write("loader", rank=core.rank, world=core.world, workers=core.loader.workers,
                         ready=core.loader.ready)
        commit_every = max(self.hooks.commit_every(core), 0)
        while not core.finished:
            epoch, start = core.progress.epoch, core.sampler.state.consumed

            def trace_step(indices: list[int], partial: StepResult) -> None:
                # Written before the all-reduce (see TrainCore.train_step), so a rank killed right
                # after a step completed still has that step on record.
                self.trace.write(
                    "step", rank=core.rank, world=core.world, epoch=epoch, start=start,
                    step=core.progress.step + 1, indices=indices, lr=core.optimizer.param_groups[0]["lr"],
                    lr_scale=core.progress.lr_scale, accumulate=partial.micro_batches, loss=partial.loss,
                )

            result = core.train_step(before_sync=trace_step if self.trace.enabled else None)
            self._images += result.images
            lr = core.optimizer.param_groups[0]["lr"]
            epoch_ended = core.end_epoch_if_done()
            core.progress.seconds += result.seconds
            for k, v in result.loss_item_means().items():
                self._epoch_loss[k] = self._epoch_loss.get(k, 0.0) + v * result.micro_batches
            self._epoch_micro += result.micro_batches
            if epoch_ended:
                entry: dict[str, Any] = {"epoch": epoch}
                if self.validate_every_epoch and core.spec.val:
                    # Every rank validates its shard together (see TrainCore.validate).
                    t_val = time.perf_counter()
                    self.last_metrics = core.validate(gather=self.hooks.gather)
                    core.progress.seconds += time.perf_counter() - t_val
                    entry.update(self.last_metrics)
                # Ultralytics' results.csv fields of the epoch (train/run_folder.py writes them).
                entry.update({f"train/{k}": v / max(self._epoch_micro, 1) for k, v in self._epoch_loss.items()})
                entry.update({f"lr/pg{i}": g["lr"] for i, g in enumerate(core.optimizer.param_groups)})
                entry["time"] = round(core.progress.seconds, 3)
                self._epoch_loss, self._epoch_micro = {}, 0
                core.progress.history.append(entry)
                # Same history on every rank (validation is gathered): the same decision everywhere.
                core.progress.stopped = should_stop(core.progress.history, core.spec.patience)
            self._emit({
                "kind": "step", "epoch": core.progress.epoch, "epochs": core.spec.epochs, "step": core.progress.step,
                "consumed": core.sampler.state.consumed, "num_samples": core.sampler.num_samples,
                "world_size": core.world, "rank": core.rank, "loss": result.loss, "lr": lr,
                "lr_scale": core.progress.lr_scale, "accumulate": result.micro_batches,
                "loss_items": result.loss_item_means(), "stopped": core.progress.stopped,
                "samples_per_s": self._throughput(result), "epoch_ended": epoch_ended, **(
                    {"metrics": self.last_metrics} if epoch_ended else {}),
            })
            if (epoch_ended or (commit_every and core.progress.step % commit_every == 0) or core.finished
                    or self.hooks.commit_now()):
                # Traced first: a Horovod commit saves locally, then may raise while checking
                # for host updates; the saved state is what a rollback returns to.
                self.trace.write("commit", rank=core.rank, step=core.progress.step, epoch=core.progress.epoch,
                                 consumed=core.progress.consumed)
                self.hooks.commit()
                commit_every = max(self.hooks.commit_every(core), 0)
        return Summary(
            epochs=core.spec.epochs, steps=core.progress.step, seconds=time.perf_counter() - t0,
            metrics=self.last_metrics, images=self._images,
        )
