"""Checkpoint dicts in the shape Ultralytics writes for last.pt, plus elasticyolo's resume fields.

Ultralytics part (so `YOLO(path)` loads it for predict/val/export, and `train(resume=True)` works
at epoch boundaries): epoch (last *completed* epoch, -1 if none), best_fitness, model (None),
ema (a CPU copy of the EMA module, NCHW), updates, optimizer, scaler, train_args, train_metrics,
train_results, date, version, license, docs.

elasticyolo part (`ckpt["elasticyolo"]`, plain dicts and tensors only, so loading never needs
elasticyolo installed): exact position (global step, epoch, step within epoch), full-precision
model and EMA state_dicts, scheduler, scaler, world size, policy and a free-form `resume` dict
(sampler state, policy ramp, RNG, ...).

The `ema` module keeps full precision, where Ultralytics writes a half copy: its tensors *are*
the EMA state_dict's, so the file stores them once (a half copy beside them would be 15 % more
bytes to copy, hash, send and store for every checkpoint). `YOLO(path)` converts to float anyway.

`build_checkpoint` is the only part that blocks training: it copies tensors to host memory (under
`shipping.capture`, straight into the shared memory the uploader process reads). Building the
`ema` module around its state (`assemble`, from the module's skeleton: `skeleton.py`), pickling,
hashing and uploading happen in the uploader process.
"""

from __future__ import annotations

import collections
import contextvars
import copy
import io
from datetime import datetime
from typing import Any, Callable, Mapping, NamedTuple

import torch
from torch import nn

from elasticyolo import __version__ as ELASTICYOLO_VERSION
from elasticyolo.checkpoint.skeleton import ModuleSkeleton, skeleton_of

FORMAT = 1
KEY = "elasticyolo"


# ---- copying to CPU (the blocking part) -----------------------------------------------------
HOST_ALLOCATOR: contextvars.ContextVar[Callable[[torch.Size, torch.dtype], torch.Tensor] | None] = \
    contextvars.ContextVar("elasticyolo_checkpoint_host_allocator", default=None)
"""Where snapshot tensors go (set by `shipping.capture`: a shared-memory slot)."""


class _Copier:
    """Copies tensors to CPU (into `HOST_ALLOCATOR`'s memory when set), contiguous: checkpoints
    hold NCHW weights even when training runs NHWC (released Ultralytics versions fuse with
    `.view()`, which fails on NHWC strides). CUDA copies are issued non_blocking and waited for
    once at the end, instead of one synchronisation per tensor."""

    def __init__(self) -> None:
        self.cuda = False
        self.alloc = HOST_ALLOCATOR.get()

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        if self.alloc is not None:
            dst = self.alloc(t.shape, t.dtype)
            self.cuda |= t.device.type == "cuda"
            dst.copy_(t, non_blocking=t.device.type == "cuda")
            return dst
        if t.device.type == "cuda":
            self.cuda = True
            return t.to("cpu", non_blocking=True, memory_format=torch.contiguous_format)
        return t.to("cpu", copy=True, memory_format=torch.contiguous_format)

    def tree(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if isinstance(obj, dict):
            out = {k: self.tree(v) for k, v in obj.items()}
            return collections.OrderedDict(out) if isinstance(obj, collections.OrderedDict) else out
        if isinstance(obj, list):
            return [self.tree(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.tree(v) for v in obj)
        return copy.deepcopy(obj)

    def finish(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") and isinstance(model.module, nn.Module) else model


def _ultralytics_version() -> str:
    try:
        from ultralytics import __version__

        return str(__version__)
    except Exception:  # noqa: BLE001 - optional
        return ""


def build_checkpoint(
    model: nn.Module,
    ema: Any,
    optimizer: torch.optim.Optimizer,
    *,
    epoch: int,
    global_step: int,
    epoch_step: int = 0,
    epoch_end: bool = False,
    train_args: Mapping[str, Any] | Any,
    world_size: int = 1,
    policy: str | None = None,
    scheduler: Any = None,
    scaler: Any = None,
    resume: Mapping[str, Any] | None = None,
    best_fitness: float | None = None,
    train_metrics: Mapping[str, Any] | None = None,
    train_results: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Snapshot the training state to CPU memory as an Ultralytics-compatible checkpoint dict.

    `ema` is an Ultralytics `ModelEMA` (or a plain module, or None to use `model`). `epoch` is the
    epoch in progress (0-based); with `epoch_end=True` it has just completed and the resume point is
    (epoch + 1, step 0), else it is (epoch, epoch_step). `resume` holds anything else that must
    survive (sampler state, policy ramp, RNG states...): tensors inside are copied to CPU too."""
    cp = _Copier()
    with torch.no_grad():
        model_sd = {k: cp.tensor(v) for k, v in _unwrap(model).state_dict().items()}
        ema_module = _unwrap(getattr(ema, "ema", ema) if ema is not None else model)
        updates = int(getattr(ema, "updates", 0) or 0)
        ema_state = ema_module.state_dict(keep_vars=True)  # one walk: the skeleton's check and the copy
        ema_skeleton = skeleton_of(ema_module, ema_state)
        ema_sd = {k: cp.tensor(v) for k, v in ema_state.items()}
        opt_sd = cp.tree(optimizer.state_dict())
        sched_sd = cp.tree(scheduler.state_dict()) if scheduler is not None else None
        scaler_sd = cp.tree(scaler.state_dict()) if scaler is not None else None
        extra = cp.tree(dict(resume or {}))
        cp.finish()
    args = dict(vars(train_args)) if not isinstance(train_args, Mapping) else dict(train_args)
    ckpt = {
        "epoch": epoch if epoch_end else epoch - 1,  # Ultralytics: last completed epoch
        "best_fitness": best_fitness,
        "stopper": {"best_fitness": best_fitness, "best_epoch": max(epoch - (0 if epoch_end else 1), 0)},
        "model": None,  # like Ultralytics: inference/export use the EMA
        "ema": ema_skeleton,  # the module, once `assemble` has built it around the EMA state
        "updates": updates,
        "optimizer": opt_sd,
        "scaler": scaler_sd,
        "train_args": args,
        "train_metrics": dict(train_metrics or {}),
        "train_results": dict(train_results or {}),
        "date": datetime.now().astimezone().isoformat(),
        "version": _ultralytics_version(),
        "license": "AGPL-3.0 (https://ultralytics.com/license)",
        "docs": "https://docs.ultralytics.com",
        KEY: {
            "format": FORMAT,
            "version": ELASTICYOLO_VERSION,
            "torch_version": torch.__version__,
            "global_step": int(global_step),
            "epoch": int(epoch),
            "epoch_step": int(epoch_step),
            "epoch_end": bool(epoch_end),
            "world_size": int(world_size),
            "policy": policy,
            "model": model_sd,
            "ema": ema_sd,
            "ema_updates": updates,
            "scheduler": sched_sd,
            "scaler": scaler_sd,
            "resume": extra,
        },
    }
    # In host memory for the uploader, the module is built there (`assemble`), not here.
    return ckpt if cp.alloc is not None else assemble(ckpt)


def assemble(ckpt: dict[str, Any]) -> dict[str, Any]:
    """Build the `ema` module around the EMA state (its tensors are the state's, stored once)."""
    skeleton = ckpt.get("ema")
    if isinstance(skeleton, ModuleSkeleton):
        ckpt["ema"] = skeleton.build(ckpt[KEY]["ema"]).eval()
    return ckpt


# ---- reading ----------------------------------------------------------------------------------
def serialize(ckpt: Mapping[str, Any], fileobj: io.IOBase | Any) -> None:
    torch.save(assemble(dict(ckpt)), fileobj)


def load_checkpoint_file(fileobj: Any) -> dict[str, Any]:
    """Unpickle a checkpoint onto the CPU. Checkpoints hold pickled modules (as Ultralytics' do):
    only load objects from a store you trust; restore checks each against its manifest's sha256."""
    ckpt = torch.load(fileobj, map_location="cpu", weights_only=False)
    if not isinstance(ckpt, dict):
        raise ValueError(f"not a checkpoint dict ({type(ckpt).__name__})")
    return ckpt


def load_checkpoint_bytes(data: bytes) -> dict[str, Any]:
    return load_checkpoint_file(io.BytesIO(data))


class ResumePoint(NamedTuple):
    epoch: int  # epoch to continue in
    epoch_step: int  # steps of that epoch already done
    global_step: int  # optimizer steps done since the start of the job


def is_elastic(ckpt: Mapping[str, Any]) -> bool:
    return isinstance(ckpt.get(KEY), dict)


def resume_fields(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    """The elasticyolo section (KeyError with a clear message for plain Ultralytics files)."""
    if not is_elastic(ckpt):
        raise KeyError("not an elasticyolo checkpoint (no 'elasticyolo' section); a plain Ultralytics "
                       "last.pt can only seed weights")
    return dict(ckpt[KEY])


def resume_point(ckpt: Mapping[str, Any]) -> ResumePoint:
    e = resume_fields(ckpt)
    if e["epoch_end"]:
        return ResumePoint(e["epoch"] + 1, 0, e["global_step"])
    return ResumePoint(e["epoch"], e["epoch_step"], e["global_step"])


def apply_checkpoint(
    ckpt: Mapping[str, Any],
    model: nn.Module,
    ema: Any = None,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    scheduler: Any = None,
    scaler: Any = None,
) -> ResumePoint:
    """Load the full-precision state into live objects (already on their device; tensors are moved
    by load_state_dict). Returns where to continue; the `resume` dict (sampler etc.) is the
    caller's: `resume_fields(ckpt)["resume"]`."""
    e = resume_fields(ckpt)
    _unwrap(model).load_state_dict(e["model"])
    if ema is not None:
        getattr(ema, "ema", ema).load_state_dict(e["ema"])
        if hasattr(ema, "updates"):
            ema.updates = int(e.get("ema_updates", ckpt.get("updates", 0)))
    if optimizer is not None and ckpt.get("optimizer") is not None:
        from elasticyolo.train.layout import align_optimizer_state

        optimizer.load_state_dict(ckpt["optimizer"])
        align_optimizer_state(optimizer)  # written from host memory in NCHW; the model may train NHWC
    if scheduler is not None and e.get("scheduler") is not None:
        scheduler.load_state_dict(e["scheduler"])
    if scaler is not None and e.get("scaler"):
        scaler.load_state_dict(e["scaler"])
    return resume_point(ckpt)


def manifest_fields(ckpt: Mapping[str, Any]) -> dict[str, Any]:
    """What the manager puts in the manifest, read from an elasticyolo checkpoint dict."""
    e = ckpt.get(KEY) or {}
    return {
        "epoch": int(e.get("epoch", max(int(ckpt.get("epoch", -1)), 0))),
        "epoch_step": int(e.get("epoch_step", 0)),
        "epoch_end": bool(e.get("epoch_end", False)),
        "world_size": int(e.get("world_size", 1)),
        "policy": e.get("policy"),
        "ultralytics_version": str(ckpt.get("version", "")),
        "torch_version": str(e.get("torch_version", torch.__version__)),
    }
