"""The model a job starts from: its architecture, its weights (`model=`, `pretrained=`, with
Ultralytics' meanings) and its frozen layers (`freeze=`, freeze.py).

* `model=ARCH.yaml`: random weights (seeded); `pretrained=W.pt` transfers W's tensors whose names
  and shapes match (Ultralytics' `DetectionModel.load`, `intersect_dicts`).
* `model=W.pt`: W's architecture and weights (its EMA, as Ultralytics loads it), a new head when
  the dataset's class count differs; `pretrained=false`: W's architecture from random weights;
  `pretrained=V.pt`: W's architecture with V's matching tensors.
* A `.pt` may be `s3://bucket/key.pt`: staged into the node's cache, checksum verified
  (`models.local_weights`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ultralytics.nn.tasks import DetectionModel, load_checkpoint
from ultralytics.utils.torch_utils import intersect_dicts

from elasticyolo.errors import UserError
from elasticyolo.models import local_weights, require_model
from elasticyolo.spec import TrainSpec
from elasticyolo.train.freeze import apply_freeze, frozen_prefixes


def load_weights(path: Path, where: str) -> DetectionModel:
    """The detection model a `.pt` holds, in float32; a one-line UserError when it holds none."""
    try:
        model, _ = load_checkpoint(str(path))
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one user-facing condition
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        why = lines[0].removeprefix("ERROR ❌️").strip() if lines else ""
        raise UserError(f"{where}: not a checkpoint Ultralytics can load ({type(exc).__name__}"
                        f"{': ' + why[:200] if why else ''})") from None
    if not isinstance(model, DetectionModel):
        raise UserError(f"{where}: holds a {type(model).__name__}, not a detection model")
    return model.float()


def _weights(name: str, option: str, spec: TrainSpec) -> DetectionModel:
    return load_weights(local_weights(name, option, spec), f"{option}={name}")


def _transfer(model: DetectionModel, source: DetectionModel, where: str) -> None:
    """Ultralytics' transfer of matching tensors; refused when nothing matches (another model family)."""
    if not intersect_dicts(source.state_dict(), model.state_dict()):
        raise UserError(f"{where}: no tensor matches the model's names and shapes (another architecture?)")
    model.load(source, verbose=False)


def build_model(spec: TrainSpec, nc: int, names: dict[int, str]) -> DetectionModel:
    """A `DetectionModel` for `nc` classes, its weights and frozen layers as the spec says."""
    name = require_model(spec.model)
    model: Any
    if name.endswith(".pt"):
        source = _weights(name, "model", spec)
        if spec.pretrained not in (None, "true"):  # its architecture: random weights, or pretrained='s below
            model = DetectionModel(cfg=source.yaml, nc=nc, ch=3, verbose=False)
        elif getattr(source, "nc", nc) != nc:  # same architecture, a new head
            model = DetectionModel(cfg=source.yaml, nc=nc, ch=3, verbose=False)
            model.load(source, verbose=False)
        else:
            model = source
    else:
        model = DetectionModel(cfg=name, nc=nc, ch=3, verbose=False)
    if spec.pretrained not in (None, "true", "false"):
        _transfer(model, _weights(spec.pretrained, "pretrained", spec), f"pretrained={spec.pretrained}")
    model.names = names
    model.nc = nc
    apply_freeze(model, frozen_prefixes(spec.freeze, len(model.model)), f"freeze={spec.freeze}")
    return model
