"""Training in NHWC (channels_last), the layout Ultralytics' trainer uses on CUDA (about half the
GPU time of NCHW for yolov8n on an H200). Forced on here, on the CPU, so that the same code paths
run without a GPU: the optimizer state follows its parameters' strides after every kind of load,
and checkpoints hold NCHW weights that `YOLO(path)` loads and fuses."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import elasticyolo.train  # noqa: E402,F401  (offline Ultralytics)
from elasticyolo.checkpoint.format import HOST_ALLOCATOR, load_checkpoint_bytes, serialize  # noqa: E402
from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.errors import UserError  # noqa: E402
from elasticyolo.spec import TrainSpec  # noqa: E402
from elasticyolo.train.core import TrainCore  # noqa: E402
from elasticyolo.train.layout import default_layout, is_channels_last, wants_channels_last  # noqa: E402
from elasticyolo.train.state import build_core_checkpoint, core_state, load_core_checkpoint, load_core_state  # noqa: E402


def test_the_layout_rule() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert wants_channels_last(cuda, None) and not wants_channels_last(cpu, None)  # Ultralytics' default
    assert wants_channels_last(cpu, True) and not wants_channels_last(cuda, False)  # forced either way
    with pytest.raises(UserError, match="channels_last"):
        TrainSpec.from_pairs(["data=x.yaml", "channels_last=sometimes"])


def _state_follows_params(core: TrainCore) -> None:
    n = 0
    for group in core.optimizer.param_groups:
        for p in group["params"]:
            for v in core.optimizer.state.get(p, {}).values():
                if torch.is_tensor(v) and v.shape == p.shape:
                    assert v.stride() == p.stride()
                    n += 1
    assert n > 0


def test_an_nhwc_core_trains_checkpoints_resumes_and_writes_nchw_weights(tmp_path: Path) -> None:
    data = write_dataset(tmp_path / "data", SynthSpec(train=8, val=2, imgsz=64, classes=3))
    spec = TrainSpec.from_pairs([f"data={data}", "imgsz=64", "batch=4", "workers=0", "epochs=2", "optimizer=AdamW",
                                 "channels_last=true", "val=false", "device=cpu"])
    core = TrainCore(spec, work_dir=tmp_path / "a")
    assert core.channels_last and is_channels_last(core.model) and is_channels_last(core.ema.ema)
    core.train_step()
    _state_follows_params(core)

    # The uploader's path: tensors copied into plain host buffers (NCHW), serialized elsewhere.
    token = HOST_ALLOCATOR.set(lambda shape, dtype: torch.empty(shape, dtype=dtype))
    try:
        ckpt = build_core_checkpoint(core)
    finally:
        HOST_ALLOCATOR.reset(token)
    buf = io.BytesIO()
    serialize(ckpt, buf)
    path = tmp_path / "last.pt"
    path.write_bytes(buf.getvalue())

    fresh = TrainCore(spec, work_dir=tmp_path / "b")
    load_core_checkpoint(fresh, load_checkpoint_bytes(path.read_bytes()))
    _state_follows_params(fresh)
    for a, b in zip(core.model.state_dict().values(), fresh.model.state_dict().values()):
        assert torch.equal(a, b)
    fresh.train_step()
    core.train_step()
    for a, b in zip(core.model.parameters(), fresh.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6)  # the same step from the same state

    # A state taken from an NCHW core (a CPU node) into an NHWC one (a GPU node), and back.
    plain = TrainCore(spec.model_copy(update={"channels_last": False}), work_dir=tmp_path / "c")
    assert not plain.channels_last and not is_channels_last(plain.model)
    load_core_state(plain, core_state(core))
    _state_follows_params(plain)
    load_core_state(fresh, core_state(plain))
    _state_follows_params(fresh)

    # Horovod's per-tensor broadcasts take NCHW only: the fallback sync converts and converts back,
    # and the EMA then still follows the model (ModelEMA had cached the tensors it updates).
    with default_layout([fresh.model, fresh.ema.ema], fresh.optimizer, fresh.ema):
        assert all(p.is_contiguous() for p in fresh.model.parameters())
        _state_follows_params(fresh)
    assert is_channels_last(fresh.model) and is_channels_last(fresh.ema.ema)
    _state_follows_params(fresh)
    weights = [t for t in fresh.ema.ema.state_dict().values() if t.dim() == 4]  # the converted ones
    before = [t.clone() for t in weights]
    fresh.train_step()
    assert any(not torch.equal(a, b) for a, b in zip(before, weights))

    # Ultralytics loads the file, fuses (with .view(): NCHW weights only) and predicts.
    from ultralytics import YOLO

    yolo = YOLO(str(path))
    assert all(p.is_contiguous() for p in yolo.model.parameters())
    import numpy as np

    img = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    assert len(yolo.predict(img, imgsz=64, verbose=False, conf=0.0)) == 1
    for c in (core, fresh, plain):
        c.close()
