"""The memory layout the model trains in: channels_last (NHWC) on CUDA, as Ultralytics' trainer.

Why: in NCHW, cuDNN runs BatchNorm with its NCHW kernels and converts layouts around every
convolution. On an H200 (yolov8n, imgsz 640, batch 16, AMP; torch.profiler) that made our step
take 1.27 ms of GPU time per image against 0.69 ms for Ultralytics' trainer, which trains NHWC
(its `channels_last` option, on by default for CUDA in 8.4).

What a layout change touches: the optimizer's state must match its parameter's strides (fused
Adam refuses a mix, and a checkpoint written from host memory holds NCHW tensors), and Horovod's
collectives take only tensors contiguous in the default layout. Values never depend on the layout;
checkpoints store the logical values (`checkpoint/format.py` writes the Ultralytics EMA in NCHW).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn


def wants_channels_last(device: torch.device, requested: bool | None) -> bool:
    """`requested` None: on for CUDA (Ultralytics' default); True/False force it either way."""
    return device.type == "cuda" if requested is None else requested


def apply_layout(modules: Iterable[nn.Module], channels_last: bool) -> None:
    """Converts the modules' 4-D parameters and buffers in place (the Parameter objects stay the
    same, so an optimizer built over them stays valid)."""
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    for m in modules:
        m.to(memory_format=fmt)


def align_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Gives every per-parameter state tensor (momentum, Adam's moments) its parameter's strides.
    Call after `load_state_dict`: loading keeps the strides the state was saved with."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, value in state.items():
                if (torch.is_tensor(value) and value.shape == p.shape and value.dim() == 4
                        and value.stride() != p.stride()):
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)


def is_channels_last(module: nn.Module) -> bool:
    return any(p.dim() == 4 and not p.is_contiguous() and p.is_contiguous(memory_format=torch.channels_last)
               for p in module.parameters())


def forget_cached_tensors(ema: Any) -> None:
    """Ultralytics' ModelEMA keeps lists of the EMA's and the model's tensors from its first
    update on; a layout change replaces those tensors, so the lists must be built again."""
    if getattr(ema, "_pairs", None) is not None:
        ema._pairs = None


@contextmanager
def default_layout(modules: list[nn.Module], optimizer: torch.optim.Optimizer, ema: Any = None) -> Iterator[None]:
    """The modules and the optimizer's state in NCHW for the duration (Horovod's per-tensor
    broadcasts require it), then back to the layout the first module had. `ema`: the ModelEMA
    that updates from these modules."""
    nhwc = bool(modules) and is_channels_last(modules[0])
    if nhwc:
        apply_layout(modules, False)
        align_optimizer_state(optimizer)
    try:
        yield
    finally:
        if nhwc:
            apply_layout(modules, True)
            align_optimizer_state(optimizer)
            forget_cached_tensors(ema)
