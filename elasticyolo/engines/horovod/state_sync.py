"""A reset's state sync in one broadcast per dtype instead of one per tensor.

Horovod's `TorchState.sync()` broadcasts the model, the EMA model and the optimizer state tensor
by tensor (about 1,500 collectives for yolov8n, each negotiated by Horovod's background loop, and
the optimizer's options object by object). That is most of what a join costs the running world.
When every rank holds the same tensors (names, shapes, dtypes; `signature`: a joiner's optimizer
state is primed, worker.py), rank 0's values travel as one flat buffer per (dtype, device), and
the few plain values (optimizer options and non-tensor state) as one pickled object.
"""

from __future__ import annotations

import hashlib
from typing import Any

import horovod.torch as hvd
import torch


def _optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The optimizer's state tensors in a fixed order, and everything else that is not a tensor."""
    tensors: list[torch.Tensor] = []
    plain: dict[str, Any] = {"groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]}
    index = 0
    for group in opt.param_groups:
        for p in group["params"]:
            for key, value in sorted(opt.state.get(p, {}).items()):
                if torch.is_tensor(value):
                    tensors.append(value)
                else:
                    plain[f"{index}.{key}"] = value
            index += 1
    return tensors, plain


def state_tensors(modules: list[torch.nn.Module], opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], dict[str, Any]]:
    tensors = [t for m in modules for t in m.state_dict().values()]
    opt_tensors, plain = _optimizer_tensors(opt)
    return tensors + opt_tensors, plain


def signature(tensors: list[torch.Tensor]) -> str:
    """Equal on two ranks when their tensors line up one to one."""
    h = hashlib.sha1()
    for t in tensors:
        h.update(f"{t.dtype}{tuple(t.shape)}{t.device.type};".encode())
    return h.hexdigest()


def broadcast_flat(tensors: list[torch.Tensor], root: int = 0) -> None:
    """Rank `root`'s values into every rank's `tensors`, one broadcast per (dtype, device)."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    for i, ((dtype, _), ts) in enumerate(sorted(groups.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1])))):
        flat = torch.cat([t.detach().reshape(-1) for t in ts])
        hvd.broadcast_(flat, root_rank=root, name=f"sync.flat.{i}.{dtype}")
        offset = 0
        with torch.no_grad():
            for t in ts:
                n = t.numel()
                t.copy_(flat[offset:offset + n].view_as(t))
                offset += n


def apply_plain(opt: torch.optim.Optimizer, plain: dict[str, Any]) -> None:
    for group, options in zip(opt.param_groups, plain["groups"]):
        group.update(options)
    index = 0
    for group in opt.param_groups:
        for p in group["params"]:
            for key in list(opt.state.get(p, {})):
                name = f"{index}.{key}"
                if name in plain:
                    opt.state[p][key] = plain[name]
            index += 1
