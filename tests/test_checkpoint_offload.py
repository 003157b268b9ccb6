"""Checkpoints cost the training process only the copy to host memory: a checkpoint lands while
training goes on, and its serialization, hashing and upload happen in another process."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from elasticyolo.checkpoint import CheckpointManager, open_store, restore_latest  # noqa: E402
from elasticyolo.checkpoint.format import resume_fields  # noqa: E402
from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.spec import TrainSpec  # noqa: E402
from support.checkpoint_faults import RecordingSerializer  # noqa: E402
from elasticyolo.local_cluster.wait import wait_for  # noqa: E402
from elasticyolo.train.core import TrainCore, quiet_ultralytics  # noqa: E402
from elasticyolo.train.digest import params_digest  # noqa: E402
from elasticyolo.train.state import build_core_checkpoint  # noqa: E402


def test_checkpoint_lands_while_training_continues_serialized_in_another_process(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    quiet_ultralytics()
    data = write_dataset(tmp_path / "d", SynthSpec(train=16, val=4, imgsz=64, classes=2))
    spec = TrainSpec.from_pairs([f"data={data}", "model=yolov8n.yaml", "epochs=50", "imgsz=64", "batch=4", "nbs=4",
                                 "warmup_epochs=0", "val=false", "optimizer=SGD", "workers=1"])
    core = TrainCore(spec, work_dir=tmp_path / "run")
    gate, record = tmp_path / "gate", tmp_path / "serialized-by"
    store = open_store(f"file://{tmp_path / 'store'}")
    mgr = CheckpointManager(store, "offload", save_period_steps=0, save_period_s=0,
                            serializer=RecordingSerializer(gate, record))

    def no_save_here(*_a: object, **_k: object) -> None:
        raise AssertionError("torch.save called in the training process")

    monkeypatch.setattr(torch, "save", no_save_here)  # this process never serializes a checkpoint
    try:
        for _ in range(3):
            core.train_step()
        step, digest = core.progress.step, params_digest(core.model)
        assert mgr.save(step, core.progress.epoch, lambda: build_core_checkpoint(core), reason="test")
        # The upload is held at serialization (in the uploader), and training goes on meanwhile.
        wait_for(record.exists, 60, "the uploader to start serializing")
        for _ in range(4):
            core.train_step()
            core.end_epoch_if_done()
        assert mgr.status()["uploading_step"] == step and mgr.last is None
        assert params_digest(core.model) != digest  # the model moved on since the snapshot
        gate.touch()
        assert mgr.wait(60), mgr.status()
    finally:
        mgr.close(30)
        core.close()
    monkeypatch.undo()

    assert int(record.read_text()) != os.getpid()  # another process (threads share this pid)
    ckpt, manifest = restore_latest(store, "offload")  # type: ignore[misc]
    assert manifest.step == step and manifest.snapshot_s < manifest.upload_s + 60
    fresh = TrainCore(spec.model_copy(update={"workers": 0}), work_dir=tmp_path / "fresh")
    try:
        from elasticyolo.train.state import load_core_checkpoint

        load_core_checkpoint(fresh, ckpt)
        assert fresh.progress.step == step
        assert params_digest(fresh.model) == pytest.approx(digest, rel=1e-12)  # the state at the snapshot
        ema = resume_fields(ckpt)["ema"]  # through the slot, the EMA is still stored once
        assert all(v.data_ptr() == ema[k].data_ptr() for k, v in ckpt["ema"].state_dict().items())
        # Serialized straight from the slot, each tensor with just its own bytes (not the slot's).
        tensors = {t.data_ptr(): t.numel() * t.element_size() for t in _tensors(ckpt)}
        assert manifest.size < sum(tensors.values()) * 1.02 + (1 << 20)
    finally:
        fresh.close()


def _tensors(obj: object) -> list["torch.Tensor"]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, torch.nn.Module):
        return list(obj.state_dict().values())
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []
