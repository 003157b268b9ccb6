"""The training loop commits where its hooks' interval says, at epoch ends and at the end, and at
any step after which the hooks' optional `commit_now()` says the world agreed to (the torch
engine: a rank was asked to stop, `engines/torch/worker.py`: a newer world is out or a rank asked to leave)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.spec import TrainSpec  # noqa: E402
from elasticyolo.train.core import TrainCore, quiet_ultralytics  # noqa: E402
from elasticyolo.train.loop import Hooks as BaseHooks, TrainingLoop  # noqa: E402


class Hooks(BaseHooks):
    def __init__(self, core: TrainCore, now_after: set[int], every: int = 0) -> None:
        self.core, self.now_after, self.every = core, now_after, every
        self.commits: list[int] = []

    def commit(self) -> None:
        self.commits.append(self.core.progress.step)

    def commit_every(self, core: TrainCore) -> int:
        return self.every

    def commit_now(self) -> bool:
        return self.core.progress.step in self.now_after


def test_a_step_the_world_agreed_on_is_a_commit_beside_the_interval_and_the_epoch_ends(tmp_path: Path) -> None:
    quiet_ultralytics()
    data = write_dataset(tmp_path / "d", SynthSpec(train=16, val=4, imgsz=64, classes=2))
    spec = TrainSpec.from_pairs([f"data={data}", "model=yolov8n.yaml", "epochs=2", "imgsz=64", "batch=4", "nbs=4",
                                 "warmup_epochs=0", "close_mosaic=0", "val=false", "workers=0", "optimizer=SGD"])
    core = TrainCore(spec, work_dir=tmp_path / "run")
    try:
        hooks = Hooks(core, now_after={2, 3}, every=3)
        TrainingLoop(core, hooks=hooks).run()
    finally:
        core.close()
    # 4 steps per epoch: every 3rd step, both epoch ends (4, 8), and steps 2 and 3 as agreed.
    assert hooks.commits == [2, 3, 4, 6, 8]
