"""Model names and weights files: which ones build offline, a clear error for those that need a
download, and where a `.pt` named by `s3://` lives on this node. No torch here."""

from __future__ import annotations

import os
import re
from pathlib import Path

from elasticyolo.errors import UserError
from elasticyolo.weights_file import check_weights_file

_WEIGHTS = re.compile(r"^(yolo(?:v3|v5|v6|v8|v9|v10|11|12|26)[a-z0-9-]*?)\.pt$", re.IGNORECASE)
WEIGHTS_HELP = "a .pt path or s3://bucket/key.pt"


def check_model_name(name: str) -> str:
    """Accept a YAML architecture name/path, a local `.pt` or an `s3://bucket/key.pt`. A bare
    weights name such as `yolov8n.pt` would need a download (impossible offline): say so and name
    the YAML."""
    if name.endswith((".yaml", ".yml")):
        if name.startswith("s3://"):
            raise ValueError(f"{name!r}: an s3:// model must be a weights file (s3://bucket/key.pt); "
                             "give a .yaml architecture as a name or a local path")
        return name
    if name.endswith(".pt"):
        return check_weights_source(name)
    raise ValueError(f"model {name!r} is neither a .yaml architecture nor {WEIGHTS_HELP}")


def check_weights_source(name: str) -> str:
    """A weights file's name as a spec gives it (`model=`, `pretrained=`): a local `.pt` (it may
    live only on the nodes: checked where it loads) or `s3://bucket/key.pt`. ValueError otherwise."""
    if name.startswith("s3://"):
        from elasticyolo.staging.stager import SourceRef

        if not name.endswith(".pt"):
            raise ValueError(f"{name!r} is not a weights file: expected s3://bucket/key.pt")
        try:
            SourceRef.parse(name)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        return name
    if not name.endswith(".pt"):
        raise ValueError(f"{name!r} is not a weights file: expected {WEIGHTS_HELP}")
    m = _WEIGHTS.match(os.path.basename(name))
    if m and not os.path.isfile(name):
        raise ValueError(
            f"{name!r} needs a weights download, which elasticyolo never does; "
            f"use model={m.group(1).lower()}.yaml (train from scratch), a local .pt path or s3://bucket/key.pt"
        )
    return name


def require_model(name: str) -> str:
    """Where the model is built: the name must be valid and a local `.pt` must exist here (an
    `s3://` one is staged by `local_weights`)."""
    try:
        name = check_model_name(name)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if name.endswith(".pt") and not name.startswith("s3://"):
        if not os.path.isfile(name):
            raise UserError(f"model file {name!r} does not exist")
        check_weights_file(Path(name), f"model={name}")
    return name


def local_weights(name: str, option: str, spec: object = None) -> Path:
    """The local path of weights `name` given as `option=` (`model`, `pretrained`): an `s3://`
    object is staged into this node's cache (checksum verified; under an agent, waited for), a
    local file must exist and look like a checkpoint. One-line errors name the option."""
    where = f"{option}={name}"
    if name.startswith("s3://"):
        from elasticyolo.s3options import s3_options
        from elasticyolo.staging.stager import resolve_staged

        return resolve_staged(name, s3_options(name, spec), option=option)
    path = Path(name).expanduser()
    if not path.is_file():
        raise UserError(f"{where}: file not found on this node")
    check_weights_file(path, where)
    return path
