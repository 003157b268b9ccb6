"""A module's structure without its state: pickled once, rebuilt around each checkpoint's state.

A checkpoint's `ema` entry must be a module (`YOLO(path)` loads it), and its tensors are the EMA
state_dict the checkpoint holds anyway. Deep-copying and pickling yolov8n's module tree for every
checkpoint took two thirds of the snapshot that blocks training. The tree does not change while
training runs, so it is pickled once per live module (again when the names, shapes or dtypes of
its state change), each state tensor replaced by its name. The process that writes the file (the
uploader) rebuilds the module around the copied state: the module's tensors *are* the state's.
"""

from __future__ import annotations

import io
import pickle
import weakref
from typing import Any, Mapping

import torch
from torch import nn

_Signature = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]


class ModuleSkeleton:
    """A pickled module whose state tensors are left out, named instead."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def build(self, state: Mapping[str, torch.Tensor]) -> nn.Module:
        """The module, its parameters and buffers being `state`'s tensors (not copies)."""
        return _Unpickler(io.BytesIO(self.data), state).load()


_CACHE: "weakref.WeakKeyDictionary[nn.Module, tuple[_Signature, ModuleSkeleton]]" = weakref.WeakKeyDictionary()


def skeleton_of(module: nn.Module, state: Mapping[str, torch.Tensor]) -> ModuleSkeleton:
    """`module`'s skeleton, pickled on first use and kept while the module lives and its state
    (`module.state_dict(keep_vars=True)`, which the caller copies too) keeps its names, shapes and
    dtypes. A training-only `criterion` attribute is left out."""
    signature = tuple((k, tuple(v.shape), v.dtype) for k, v in state.items())
    cached = _CACHE.get(module)
    if cached is not None and cached[0] == signature:
        return cached[1]
    names = {id(v): k for k, v in state.items()}
    crit = getattr(module, "criterion", None)
    buf = io.BytesIO()
    _Pickler(buf, names, {id(crit)} if crit is not None else set()).dump(module)
    skeleton = ModuleSkeleton(buf.getvalue())
    _CACHE[module] = (signature, skeleton)
    return skeleton


def _tensor(data: bytes, dtype: str, shape: tuple[int, ...], requires_grad: bool) -> torch.Tensor:
    if not data:  # frombuffer refuses an empty buffer
        return torch.empty(shape, dtype=getattr(torch, dtype), requires_grad=requires_grad)
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)
    return t.requires_grad_(requires_grad) if requires_grad else t


class _Pickler(pickle.Pickler):
    def __init__(self, file: Any, names: dict[int, str], drop: set[int]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.names, self.drop = names, drop

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            name = self.names.get(id(obj))
            if name is None:
                return None
            return ("state", name, isinstance(obj, nn.Parameter), bool(obj.requires_grad))
        if id(obj) in self.drop:
            return ("none",)
        return None

    def reducer_override(self, obj: Any) -> Any:
        # Plain tensor attributes (cached anchors and strides, small) go by value as raw bytes:
        # from the GPU too, and without torch.save, which the training process never runs.
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor, (raw, str(t.dtype).removeprefix("torch."), tuple(t.shape), bool(obj.requires_grad))
        return NotImplemented


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, state: Mapping[str, torch.Tensor]) -> None:
        super().__init__(file)
        self.state = state

    def persistent_load(self, pid: Any) -> Any:
        if pid[0] == "none":
            return None
        _, name, is_param, requires_grad = pid
        t = self.state[name]
        return nn.Parameter(t, requires_grad=requires_grad) if is_param else t
