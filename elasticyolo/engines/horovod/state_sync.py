"""A reset's state sync in one collective per device instead of one broadcast per tensor.

Horovod's `TorchState.sync()` broadcasts the model, the EMA model and the optimizer state tensor
by tensor (about 1,500 collectives for yolov8n, each negotiated by Horovod's background loop, and
the optimizer's options object by object). That is most of what a join costs the running world.
When every rank holds the same tensors (names, shapes, dtypes; `signature`: a joiner's optimizer
state is primed, worker.py), the values travel as raw bytes in one alltoall per device, and only
to the ranks that differ from rank 0 (`send_shards`): on a join the survivors already hold the
state, so each of them sends a share of it to the newcomers and copies nothing in. The few plain
values (optimizer options and non-tensor state) go as one pickled object.
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


_ALIGN = 16  # bytes: a shard boundary never splits an element of any dtype


def shard_bounds(total: int, senders: int) -> list[tuple[int, int]]:
    """Byte ranges of `total` bytes for `senders` senders: contiguous, in order, near equal."""
    cuts = [min(total, (total * j // senders) // _ALIGN * _ALIGN) for j in range(senders)] + [total]
    return [(cuts[j], cuts[j + 1]) for j in range(senders)]


def _byte_layout(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
    """(tensor, offset, nbytes) in one byte space per device; larger elements first, so every
    offset is a multiple of its tensor's element size (a received slice views as its dtype)."""
    layout, offset = [], 0
    for t in sorted(tensors, key=lambda t: -t.element_size()):  # stable: same order on every rank
        n = t.numel() * t.element_size()
        layout.append((t, offset, n))
        offset += n
    return layout


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def _shard(layout: list[tuple[torch.Tensor, int, int]], lo: int, hi: int) -> list[torch.Tensor]:
    pieces = []
    for t, offset, n in layout:
        a, b = max(lo, offset), min(hi, offset + n)
        if a < b:
            pieces.append(_bytes_of(t)[a - offset:b - offset])
    return pieces


def send_shards(tensors: list[torch.Tensor], senders: list[int], receivers: list[int]) -> None:
    """The senders' values (the same on each: they hold rank 0's state) into every receiver's
    `tensors`, one alltoall per device. Sender j (in rank order) sends byte range j of the state,
    so the senders share the work; ranks that hold the state already receive nothing. Every rank
    calls it with the same `senders` and `receivers`."""
    rank, size = hvd.rank(), hvd.size()
    assert senders and not set(senders) & set(receivers), (senders, receivers)
    senders = sorted(senders)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for i, (device, ts) in enumerate(sorted(by_device.items(), key=lambda kv: str(kv[0]))):
        layout = _byte_layout(ts)
        total = sum(n for _, _, n in layout)
        splits = torch.zeros(size, dtype=torch.int32)
        if rank in senders:
            lo, hi = shard_bounds(total, len(senders))[senders.index(rank)]
            shard = _shard(layout, lo, hi)
            payload = torch.cat(shard * len(receivers)) if receivers and hi > lo else \
                torch.empty(0, dtype=torch.uint8, device=device)
            for r in receivers:
                splits[r] = hi - lo
        else:
            payload = torch.empty(0, dtype=torch.uint8, device=device)
        received, _ = hvd.alltoall(payload, splits=splits, name=f"sync.shards.{i}")
        if rank not in receivers:
            continue
        assert received.numel() == total, (received.numel(), total)  # shards arrive in rank order
        with torch.no_grad():
            for t, offset, n in layout:
                t.copy_(received[offset:offset + n].view(t.dtype).view(t.shape))


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
