"""Cheap fingerprints of training state, written into worker traces so tests can show that
ranks hold identical weights after a sync and that a restore brought back the saved optimizer."""

from __future__ import annotations

from typing import Any, Mapping

import torch


def params_digest(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(sum(p.double().sum() * (i + 1) for i, p in enumerate(model.parameters())))


def optimizer_state_digest(state_dict: Mapping[str, Any]) -> float:
    """Over an optimizer `state_dict()`: every per-parameter state tensor, position-weighted."""
    total = 0.0
    with torch.no_grad():
        for i, (_, per_param) in enumerate(sorted(state_dict["state"].items())):
            for name in sorted(per_param):
                v = per_param[name]
                if isinstance(v, torch.Tensor):
                    total += float(v.double().sum()) * (i + 1)
    return total
