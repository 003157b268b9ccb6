"""Model names: which ones build offline, and a clear error for those that need a download."""

from __future__ import annotations

import os
import re

from elasticyolo.errors import UserError

_WEIGHTS = re.compile(r"^(yolo(?:v3|v5|v6|v8|v9|v10|11|12|26)[a-z0-9-]*?)\.pt$", re.IGNORECASE)


def check_model_name(name: str) -> str:
    """Accept a YAML architecture name/path or an existing local `.pt`. A bare weights name such as
    `yolov8n.pt` would need a download (impossible offline): say so and name the YAML."""
    if name.endswith((".yaml", ".yml")):
        return name
    if name.endswith(".pt"):
        m = _WEIGHTS.match(os.path.basename(name))
        if m and not os.path.isfile(name):
            raise ValueError(
                f"{name!r} needs a weights download, which elasticyolo never does; "
                f"use model={m.group(1).lower()}.yaml (train from scratch) or a local .pt path"
            )
        return name  # a local checkpoint: it may live only on the nodes, checked where it loads
    raise ValueError(f"model {name!r} is neither a .yaml architecture nor a local .pt file")


def require_model(name: str) -> str:
    """Where the model is built: the name must be valid and a `.pt` must exist here."""
    try:
        name = check_model_name(name)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    if name.endswith(".pt") and not os.path.isfile(name):
        raise UserError(f"model file {name!r} does not exist")
    return name
