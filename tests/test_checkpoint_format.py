"""Ultralytics-compatible checkpoint files: `YOLO(path)` loads and predicts; exact resume state."""

from __future__ import annotations

import io
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from elasticyolo.exit_hooks import at_exit

_HOME = tempfile.mkdtemp(prefix="ey-ckpt-yolo-")
at_exit(shutil.rmtree, _HOME, ignore_errors=True)
os.environ["YOLO_OFFLINE"] = "1"  # never fetch anything
os.environ["YOLO_AUTOINSTALL"] = "False"
os.environ.setdefault("YOLO_CONFIG_DIR", _HOME)
os.environ.setdefault("MPLCONFIGDIR", _HOME)
os.environ.setdefault("YOLO_VERBOSE", "False")

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")
pytest.importorskip("ultralytics")

from elasticyolo.checkpoint.format import (  # noqa: E402
    KEY, apply_checkpoint, build_checkpoint, load_checkpoint_bytes, manifest_fields, resume_fields, resume_point)


def make_state(seed: int = 0) -> dict[str, Any]:
    """A yolov8n DetectionModel (nc=3, from YAML: no weights download), AdamW, EMA, after 2 steps."""
    from ultralytics.cfg import get_cfg
    from ultralytics.nn.tasks import DetectionModel
    from ultralytics.utils.torch_utils import ModelEMA

    torch.manual_seed(seed)
    model = DetectionModel("yolov8n.yaml", nc=3, verbose=False)
    model.args = get_cfg(overrides={"imgsz": 64})
    model.names = {0: "red", 1: "green", 2: "blue"}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0 - 0.1 * e)
    ema = ModelEMA(model)
    model.train()
    for _ in range(2):
        out = model(torch.randn(2, 3, 64, 64))
        vals = out.values() if isinstance(out, dict) else out
        opt.zero_grad()
        sum(v.float().mean() for v in vals if torch.is_tensor(v)).backward()
        opt.step()
        sched.step()
        ema.update(model)
    return {"model": model, "ema": ema, "opt": opt, "sched": sched}


def snapshot(st: dict[str, Any], **kw: Any) -> dict[str, Any]:
    args = dict(epoch=1, global_step=12, epoch_step=4, world_size=2, policy="linear",
                train_args=vars(st["model"].args), scheduler=st["sched"],
                resume={"sampler": {"epoch": 1, "consumed": 32}, "rng": torch.get_rng_state()})
    args.update(kw)
    return build_checkpoint(st["model"], st["ema"], st["opt"], **args)


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    return make_state()


def _bytes(ckpt: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    return buf.getvalue()


def test_module_skeleton_is_pickled_once_and_rebuilt_around_the_state(state: dict[str, Any]) -> None:
    import copy

    from elasticyolo.checkpoint.skeleton import skeleton_of

    ema = copy.deepcopy(state["ema"].ema)
    ema.criterion = object()  # training-only: left out
    ema.cached = torch.arange(3.0)  # a plain tensor attribute: kept, by value
    skeleton = skeleton_of(ema, ema.state_dict(keep_vars=True))
    # pickled once while the module's state keeps its shape
    assert skeleton_of(ema, ema.state_dict(keep_vars=True)) is skeleton
    sd = {k: v.detach().clone() for k, v in ema.state_dict().items()}
    built = skeleton.build(sd)
    assert type(built) is type(ema) and built.criterion is None and torch.equal(built.cached, ema.cached)
    assert all(built.state_dict()[k].data_ptr() == v.data_ptr() for k, v in sd.items())  # the state's tensors
    assert [n for n, _ in built.named_parameters()] == [n for n, _ in ema.named_parameters()]
    assert not any(p.requires_grad for p in built.parameters())
    ema.register_buffer("added", torch.zeros(2))  # the state changed shape: pickled again
    again = skeleton_of(ema, ema.state_dict(keep_vars=True))
    assert again is not skeleton and "added" in again.build(dict(ema.state_dict())).state_dict()


def test_snapshot_is_a_cpu_copy(state: dict[str, Any]) -> None:
    ckpt = snapshot(state)
    live = state["ema"].ema.state_dict()
    e = resume_fields(ckpt)
    module = ckpt["ema"].state_dict()
    for k, v in e["ema"].items():  # full precision, copied, and the Ultralytics module holds the same tensors
        assert v.dtype == live[k].dtype and torch.equal(v, live[k]) and v.data_ptr() != live[k].data_ptr()
        assert module[k].data_ptr() == v.data_ptr()
    loaded = torch.load(io.BytesIO(_bytes(ckpt)), weights_only=False)  # and the file stores them once
    for k, v in loaded[KEY]["ema"].items():
        assert loaded["ema"].state_dict()[k].data_ptr() == v.data_ptr()
    assert ckpt["model"] is None and ckpt["epoch"] == 0 and ckpt["updates"] == state["ema"].updates
    assert {"optimizer", "train_args", "date", "version", "license", "docs", "best_fitness"} <= set(ckpt)
    # Mutating the live state afterwards must not change the snapshot.
    before = e["model"]["model.0.conv.weight"].clone()
    with torch.no_grad():
        next(state["model"].parameters()).add_(1.0)
    assert torch.equal(e["model"]["model.0.conv.weight"], before)
    with torch.no_grad():
        next(state["model"].parameters()).sub_(1.0)
    assert resume_point(ckpt) == (1, 4, 12)
    assert resume_point(snapshot(state, epoch_end=True)) == (2, 0, 12)
    f = manifest_fields(ckpt)
    assert f["world_size"] == 2 and f["policy"] == "linear" and f["epoch_step"] == 4


def test_yolo_loads_and_predicts(state: dict[str, Any], tmp_path: Path) -> None:
    from ultralytics import YOLO

    path = tmp_path / "ckpt.pt"
    path.write_bytes(_bytes(snapshot(state)))
    yolo = YOLO(str(path))
    assert yolo.names == {0: "red", 1: "green", 2: "blue"}
    img = np.random.default_rng(0).integers(0, 255, (96, 128, 3), dtype=np.uint8)
    results = yolo.predict(img, imgsz=64, verbose=False, conf=0.0)
    assert len(results) == 1 and results[0].boxes is not None


def test_exact_resume_round_trip(state: dict[str, Any]) -> None:
    ckpt = load_checkpoint_bytes(_bytes(snapshot(state)))
    fresh = make_state(seed=1)  # different weights and optimizer state
    point = apply_checkpoint(ckpt, fresh["model"], fresh["ema"], fresh["opt"], scheduler=fresh["sched"])
    assert point.global_step == 12
    for a, b in zip(state["model"].state_dict().values(), fresh["model"].state_dict().values()):
        assert torch.equal(a, b)
    for a, b in zip(state["ema"].ema.state_dict().values(), fresh["ema"].ema.state_dict().values()):
        assert torch.equal(a, b)
    assert fresh["ema"].updates == state["ema"].updates
    s1, s2 = state["opt"].state_dict(), fresh["opt"].state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(s1["state"][k][name], s2["state"][k][name])
    assert fresh["sched"].state_dict()["last_epoch"] == state["sched"].state_dict()["last_epoch"]
    assert resume_fields(ckpt)["resume"]["sampler"] == {"epoch": 1, "consumed": 32}


def test_plain_ultralytics_file_is_not_resumable() -> None:
    with pytest.raises(KeyError, match="not an elasticyolo checkpoint"):
        resume_point({"epoch": 3, "ema": None})
