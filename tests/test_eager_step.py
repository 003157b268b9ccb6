"""Optimizers step without importing torch._dynamo (train/eager_step.py): the same parameters as
torch's own step, the same hooks, and a worker's whole training path (steps, rollback state,
checkpoint file) never imports it."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from elasticyolo.train.eager_step import eager_step  # noqa: E402

OPTIMIZERS = {
    "SGD": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "AdamW": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05),
    "Adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_the_eager_step_trains_exactly_as_torchs_step_and_runs_the_hooks(name: str) -> None:
    torch.manual_seed(0)
    plain_model = torch.nn.Linear(4, 3)
    eager_model = copy.deepcopy(plain_model)
    plain, eager = OPTIMIZERS[name](plain_model.parameters()), OPTIMIZERS[name](eager_model.parameters())
    assert eager_step(eager)
    pre, post = [], []
    eager.register_step_pre_hook(lambda *a: pre.append(1))
    eager.register_step_post_hook(lambda *a: post.append(1))
    for _ in range(5):
        x = torch.randn(8, 4)
        for model, opt in ((plain_model, plain), (eager_model, eager)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(plain_model.parameters(), eager_model.parameters()))
    assert len(pre) == len(post) == 5


def test_a_differentiable_optimizer_keeps_torchs_step() -> None:
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1, differentiable=True)
    assert not eager_step(opt)
    assert "step" not in vars(opt)


def test_a_workers_training_path_never_imports_dynamo(tmp_path: Path) -> None:
    """In a fresh process, as a worker runs: the training core, steps through an epoch end, the
    commit's in-memory state and a checkpoint file."""
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from elasticyolo.data.synth import SynthSpec, write_dataset
        from elasticyolo.spec import TrainSpec
        from elasticyolo.train.core import TrainCore, quiet_ultralytics
        from elasticyolo.train.loop import Hooks, TrainingLoop
        from elasticyolo.train.state import clone_state, core_state, save_checkpoint_file
        quiet_ultralytics()
        data = write_dataset(Path({str(tmp_path / 'd')!r}), SynthSpec(train=8, val=4, imgsz=64, classes=2))
        spec = TrainSpec.from_pairs([f"data={{data}}", "model=yolov8n.yaml", "epochs=2", "imgsz=64", "batch=4",
                                     "nbs=4", "warmup_epochs=0", "close_mosaic=0", "val=false", "workers=0",
                                     "optimizer=SGD"])
        core = TrainCore(spec, work_dir={str(tmp_path / 'run')!r})
        try:
            TrainingLoop(core, hooks=Hooks()).run()
            clone_state(core_state(core))
            save_checkpoint_file(core, {str(tmp_path / 'last.pt')!r})
        finally:
            core.close()
        print("steps", core.progress.step, "dynamo", "torch._dynamo" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == ["steps", "4", "dynamo", "False"], out.stdout[-2000:]
