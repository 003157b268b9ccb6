"""Save and load a `TrainCore`'s full training state.

Two shapes:
* `core_state(core)` / `load_core_state(core, state)`: a lean dict of CPU tensors (model, EMA,
  optimizer, AMP scaler, progress). Node-local snapshots (`train/snapshots.py`) store it and ranks
  hand it to each other; it is cheap because nothing is deep-copied as a module.
* `build_core_checkpoint(core)` / `load_core_checkpoint(core, ckpt)`: the Ultralytics-compatible
  checkpoint of `elasticyolo.checkpoint.format` (`YOLO(path)` loads it), with the progress
  record in its `resume` section. `save_checkpoint_file(core, path)` writes one
  (`write_checkpoint_file(ckpt, path)`: one already built).

Loading never changes the world size: callers call `core.set_world(world, rank)` afterwards, which
applies the rescaling policy (and starts the LR ramp when the saved world differs).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from elasticyolo.train.layout import align_optimizer_state

if TYPE_CHECKING:
    from elasticyolo.train.core import Progress, TrainCore

STATE_FORMAT = 1


def _cpu(obj: Any, into: Any = None) -> Any:
    """Deep copy of a state_dict tree with every tensor cloned onto the CPU. `into`: a tree of the
    same shape from an earlier copy, whose tensors are written in place where they match (a copy
    kept at every commit then allocates nothing)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        if (isinstance(into, torch.Tensor) and into.shape == t.shape and into.dtype == t.dtype
                and into.device.type == "cpu" and into.is_contiguous() and t.stride() == into.stride()):
            return into.copy_(t)
        return t.to("cpu", copy=True) if t.device.type == "cpu" else t.to("cpu")
    if isinstance(obj, dict):
        prev = into if isinstance(into, dict) else {}
        return type(obj)((k, _cpu(v, prev.get(k))) for k, v in obj.items())
    if isinstance(obj, list):
        prev_list = into if isinstance(into, list) and len(into) == len(obj) else [None] * len(obj)
        return [_cpu(v, p) for v, p in zip(obj, prev_list)]
    if isinstance(obj, tuple):
        return tuple(_cpu(v) for v in obj)
    return obj


def clone_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a `core_state` dict that shares no tensor with it (loading a state hands its
    tensors to the optimizer, which then trains in them)."""
    return _cpu(dict(state))  # type: ignore[no-any-return]


def progress_dict(core: "TrainCore") -> dict[str, Any]:
    return asdict(core.progress)


def progress_from(data: Mapping[str, Any]) -> "Progress":
    from elasticyolo.train.core import Progress

    known = {f.name for f in fields(Progress)}
    return Progress(**{k: v for k, v in data.items() if k in known})


def core_state(core: "TrainCore", into: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything needed to continue exactly here, as CPU tensors and plain objects. `into`: an
    earlier `core_state` that is no longer needed, whose tensors are reused."""
    prev: Mapping[str, Any] = into or {}
    with torch.no_grad():
        return {
            "format": STATE_FORMAT,
            "model": _cpu(core.model.state_dict(), prev.get("model")),
            "ema": _cpu(core.ema.ema.state_dict(), prev.get("ema")),
            "ema_updates": int(core.ema.updates),
            "optimizer": _cpu(core.optimizer.state_dict(), prev.get("optimizer")),
            "scaler": core.scaler.state_dict() if core.scaler.is_enabled() else None,
            "progress": progress_dict(core),
        }


def load_core_state(core: "TrainCore", state: Mapping[str, Any]) -> None:
    """Load a `core_state` dict into a live core (tensors move to the core's device)."""
    if state.get("format") != STATE_FORMAT:
        raise ValueError(f"unknown training state format {state.get('format')!r}")
    core.model.load_state_dict(state["model"])
    core.ema.ema.load_state_dict(state["ema"])
    core.ema.updates = int(state["ema_updates"])
    core.optimizer.load_state_dict(state["optimizer"])
    align_optimizer_state(core.optimizer)  # saved from host memory in NCHW; the model may train NHWC
    if state.get("scaler") and core.scaler.is_enabled():
        core.scaler.load_state_dict(state["scaler"])
    core.progress = progress_from(state["progress"])
    core.sync_sampler_from_progress()


def _copy_into(live: Any, saved: Any) -> bool:
    """Copy a saved state_dict tree into the live one's tensors; False (and nothing guaranteed
    about what was copied) where the two trees differ in shape."""
    if isinstance(live, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != live.shape or saved.dtype != live.dtype:
            return False
        live.copy_(saved)
        return True
    if isinstance(live, dict):
        return isinstance(saved, dict) and live.keys() == saved.keys() and all(
            _copy_into(v, saved[k]) for k, v in live.items())
    if isinstance(live, (list, tuple)):
        return isinstance(saved, (list, tuple)) and len(live) == len(saved) and all(
            _copy_into(a, b) for a, b in zip(live, saved))
    return True  # a plain value: set below, where it is one the core keeps


def roll_back(core: "TrainCore", state: Mapping[str, Any]) -> None:
    """The live core back at `state` (a `core_state` it trained on from): its values copied into
    the tensors the core trains in, so `state` stays intact and nothing is allocated. Where the
    optimizer's state changed shape since (its first step), a copy of `state` is loaded instead."""
    opt = core.optimizer
    saved_opt = state["optimizer"]
    params = [p for g in opt.param_groups for p in g["params"]]  # the index state_dict() numbers them by
    live_opt = {i: opt.state[p] for i, p in enumerate(params) if p in opt.state}
    with torch.no_grad():
        in_place = (len(opt.param_groups) == len(saved_opt["param_groups"])
                    and _copy_into(live_opt, saved_opt["state"])
                    and _copy_into(core.model.state_dict(), state["model"])
                    and _copy_into(core.ema.ema.state_dict(), state["ema"]))
    if not in_place:
        load_core_state(core, clone_state(state))
        return
    for group, saved in zip(opt.param_groups, saved_opt["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
    for i, saved_state in saved_opt["state"].items():
        live_opt[i].update({k: v for k, v in saved_state.items() if not isinstance(v, torch.Tensor)})
    core.ema.updates = int(state["ema_updates"])
    if state.get("scaler") and core.scaler.is_enabled():
        core.scaler.load_state_dict(state["scaler"])
    core.progress = progress_from(state["progress"])
    core.sync_sampler_from_progress()


def state_step(state: Mapping[str, Any]) -> int:
    return int(state["progress"]["step"])


# ---- Ultralytics-compatible checkpoints ------------------------------------------------------
def _position(core: "TrainCore") -> tuple[int, int, bool]:
    """(epoch, steps done in it, epoch_end) for the checkpoint format. Right after an epoch ended
    the progress points at (next epoch, 0): record that as the end of the previous epoch."""
    p = core.progress
    if p.consumed == 0 and p.epoch > 0:
        return p.epoch - 1, 0, True
    per_step = max(core.world * core.spec.batch * max(core.scaling.accumulate, 1), 1)
    return p.epoch, math.ceil(p.consumed / per_step), False


def build_core_checkpoint(core: "TrainCore") -> dict[str, Any]:
    from elasticyolo.checkpoint.format import build_checkpoint

    epoch, epoch_step, epoch_end = _position(core)
    from elasticyolo.train.fitness import best_epoch

    metrics = core.progress.history[-1] if core.progress.history else {}
    best = best_epoch(core.progress.history)
    fitness = best[1] if best else None  # Ultralytics' best_fitness: the best so far
    return build_checkpoint(
        core.model, core.ema, core.optimizer, epoch=epoch, global_step=core.progress.step, epoch_step=epoch_step,
        epoch_end=epoch_end, train_args=core.hyp, world_size=core.world, policy=core.spec.policy,
        scaler=core.scaler if core.scaler.is_enabled() else None, resume={"progress": progress_dict(core)},
        best_fitness=fitness, train_metrics=metrics,
    )


def load_core_checkpoint(core: "TrainCore", ckpt: Mapping[str, Any]) -> None:
    """Load an elasticyolo checkpoint (see `build_core_checkpoint`) into a live core."""
    from elasticyolo.checkpoint.format import apply_checkpoint, resume_fields

    apply_checkpoint(ckpt, core.model, core.ema, core.optimizer,
                     scaler=core.scaler if core.scaler.is_enabled() else None)
    resume = resume_fields(ckpt).get("resume") or {}
    if "progress" in resume:
        core.progress = progress_from(resume["progress"])
    else:  # written by another tool: rebuild the position from the format's fields
        from elasticyolo.checkpoint.format import resume_point

        rp = resume_point(ckpt)
        core.progress.epoch, core.progress.step, core.progress.consumed = rp.epoch, rp.global_step, 0
    core.sync_sampler_from_progress()


def save_checkpoint_file(core: "TrainCore", path: str | os.PathLike[str]) -> None:
    """Write `core` as a `.pt` that `ultralytics.YOLO(path)` loads (and elasticyolo resumes)."""
    write_checkpoint_file(build_core_checkpoint(core), path)


def write_checkpoint_file(ckpt: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Write a `build_core_checkpoint` dict to `path`, atomically (a temp file, then a rename)."""
    from elasticyolo.checkpoint.format import serialize

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        serialize(ckpt, fh)
    os.replace(tmp, path)
