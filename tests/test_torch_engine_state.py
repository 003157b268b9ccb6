"""Training-state round trips used by the torch engine (`elasticyolo.train.state`), the local
snapshot writer, and the agent hook's small helpers. One process, real YOLO model, no etcd."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.spec import TrainSpec  # noqa: E402


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> TrainSpec:
    data = write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=16, val=4, imgsz=64, classes=2))
    return TrainSpec.from_pairs([f"data={data}", "epochs=3", "imgsz=64", "batch=4", "nbs=8", "warmup_epochs=0",
                                 "close_mosaic=0", "val=false", "amp=false", "engine=torch",
                                 "mosaic=0"])  # mosaic samples from a per-dataset buffer: not training state


def trained_core(spec: TrainSpec, steps: int):  # type: ignore[no-untyped-def]
    from elasticyolo.train.core import TrainCore

    core = TrainCore(spec)
    for _ in range(steps):
        core.train_step()
        core.end_epoch_if_done()
    return core


def assert_same(a, b) -> None:  # type: ignore[no-untyped-def]
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb), ka
    for va, vb in zip(a.ema.ema.state_dict().values(), b.ema.ema.state_dict().values()):
        assert torch.equal(va, vb)
    assert a.ema.updates == b.ema.updates
    assert a.progress == b.progress
    assert a.sampler.state == b.sampler.state
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        assert all(torch.equal(sa[k][n], sb[k][n]) if isinstance(sa[k][n], torch.Tensor) else sa[k][n] == sb[k][n]
                   for n in sa[k])


def test_core_state_round_trip_through_a_local_snapshot(spec: TrainSpec, tmp_path: Path) -> None:
    from elasticyolo.train.snapshots import LocalSnapshots
    from elasticyolo.train.core import TrainCore
    from elasticyolo.train.state import core_state, load_core_state

    core = trained_core(spec, 3)  # 2 steps per epoch at world 1 (accumulate 2): mid-epoch 1
    assert (core.progress.epoch, core.progress.step, core.progress.consumed) == (1, 3, 8)
    snaps = LocalSnapshots(tmp_path / "snap")
    assert snaps.read() is None
    snaps.submit(core_state(core))
    snaps.close()
    fresh = TrainCore(spec)
    load_core_state(fresh, snaps.read())  # type: ignore[arg-type]
    assert_same(core, fresh)
    # Both continue identically from there (augmentation RNGs are not training state: seed them).
    for c in (core, fresh):
        random.seed(1), np.random.seed(1), torch.manual_seed(1)
        c.train_step()
    assert_same(core, fresh)


def test_a_roll_back_copies_the_commit_into_the_live_tensors_and_keeps_it(spec: TrainSpec) -> None:
    """What a survivor does when a collective failed after its commit (engines/torch/worker.py):
    the core returns to the commit in place, and the commit stays the rollback point."""
    from elasticyolo.train.core import TrainCore
    from elasticyolo.train.state import core_state, load_core_state, roll_back

    core = trained_core(spec, 3)
    committed = core_state(core)
    reference = TrainCore(spec)
    load_core_state(reference, core_state(core))
    live = [t.data_ptr() for t in core.model.state_dict().values()]
    for _ in range(2):  # trained past the commit, across an epoch end
        core.train_step()
        core.end_epoch_if_done()
    assert core.progress.step == 5
    for _ in range(2):  # a second roll-back to the same commit finds it intact
        roll_back(core, committed)
        assert_same(core, reference)
        assert [t.data_ptr() for t in core.model.state_dict().values()] == live  # in place
        core.train_step()
    # A commit taken before the optimizer's first step differs in shape: loaded instead.
    fresh = TrainCore(spec)
    before_first_step = core_state(fresh)
    fresh.train_step()
    roll_back(fresh, before_first_step)
    assert fresh.progress.step == 0 and not fresh.optimizer.state_dict()["state"]


def test_torn_snapshot_reads_as_none(tmp_path: Path) -> None:
    from elasticyolo.train.snapshots import read_snapshot

    (tmp_path / "state.pt").write_bytes(b"\x80\x02garbage")
    assert read_snapshot(tmp_path / "state.pt") is None
    assert read_snapshot(tmp_path / "missing.pt") is None


def test_checkpoint_file_loads_with_yolo_and_resumes(spec: TrainSpec, tmp_path: Path) -> None:
    from ultralytics import YOLO

    from elasticyolo.checkpoint.format import load_checkpoint_file
    from elasticyolo.train.core import TrainCore
    from elasticyolo.train.state import load_core_checkpoint, save_checkpoint_file

    core = trained_core(spec, 2)  # exactly one epoch: an epoch-end checkpoint
    path = tmp_path / "last.pt"
    save_checkpoint_file(core, path)
    model = YOLO(str(path))
    assert model.names == core.data["names"]
    with open(path, "rb") as fh:
        ckpt = load_checkpoint_file(fh)
    assert ckpt["epoch"] == 0 and ckpt["elasticyolo"]["epoch_end"]
    fresh = TrainCore(spec)
    load_core_checkpoint(fresh, ckpt)
    assert_same(core, fresh)


def test_no_torch_in_the_agent() -> None:
    import subprocess

    code = ("import sys, elasticyolo.commands.agent, elasticyolo.engines.torch.node,"
            " elasticyolo.engines.torch.coordinator, elasticyolo.agent.daemon;"
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
