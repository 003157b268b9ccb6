"""How the learning rate and gradient accumulation follow the world size.

- `linear`: LR proportional to world size (Goyal et al.): lr = lr0 * world / ref_world, with a
  linear ramp from the previous LR over `resize_warmup_steps` optimizer steps after every resize.
  Accumulation follows Ultralytics' nominal batch for the reference world.
- `constant_global_batch`: the global batch (batch * world * accumulate) is held at its value
  for `ref_world`; accumulation steps follow the world size; LR unchanged.

Pure functions: unit-testable, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scaling:
    lr_scale: float  # multiplies every param group's scheduled LR
    accumulate: int  # micro-steps per optimizer step
    global_batch: int  # images per optimizer step across the world


def nominal_accumulate(nbs: int, batch: int, world: int) -> int:
    """Ultralytics: accumulate = max(round(nbs / (batch * world)), 1)."""
    return max(round(nbs / (batch * world)), 1)


def scaling_for(policy: str, world: int, *, batch: int, nbs: int, ref_world: int = 1) -> Scaling:
    if world < 1:
        raise ValueError("world size must be >= 1")
    if policy == "linear":
        acc = nominal_accumulate(nbs, batch, ref_world)
        return Scaling(lr_scale=world / ref_world, accumulate=acc, global_batch=batch * world * acc)
    if policy == "constant_global_batch":
        target = batch * ref_world * nominal_accumulate(nbs, batch, ref_world)
        acc = max(round(target / (batch * world)), 1)
        return Scaling(lr_scale=1.0, accumulate=acc, global_batch=batch * world * acc)
    raise ValueError(f"unknown policy {policy!r}")


def resize_ramp(prev_scale: float, new_scale: float, steps_since_resize: int, ramp_steps: int) -> float:
    """LR scale during the warmup after a resize: linear from the old to the new scale."""
    if ramp_steps <= 0 or steps_since_resize >= ramp_steps:
        return new_scale
    t = steps_since_resize / ramp_steps
    return prev_scale + (new_scale - prev_scale) * t
