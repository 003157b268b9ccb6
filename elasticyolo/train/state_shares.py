"""A world's training state moved to the ranks that lack it, in shares, for every engine.

Broadcasting a state tensor by tensor costs one collective per tensor (about 1,500 for yolov8n:
model, EMA model, optimizer), and pickling it whole costs a serialization on the sender and a
parse on every receiver. When every rank holds the same tensors (names, shapes, dtypes:
`signature`; a joiner's optimizer state is primed first, `prime_optimizer_state`), the values
travel as raw bytes in one all-to-all per device, only to the ranks that lack them
(`send_shards`): on a join the survivors hold the state, so each sends a share of it to the
newcomers and copies nothing in. The few plain values (optimizer options, non-tensor state) go
as one pickled object (`apply_plain` on the receivers). The all-to-all is the engine's.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable

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


# A collective that sends each rank `splits[r]` bytes of `payload` (in rank order) and returns what
# every rank sent this one, concatenated in rank order: Horovod's alltoall, torch's
# all_to_all_single. Its third argument is what this rank receives from each rank (known to every
# rank from the layout: an engine whose all-to-all needs it passes it on instead of exchanging
# the sizes first); its fourth numbers the calls of one transfer (one per device).
AllToAll = Callable[[torch.Tensor, list[int], list[int], int], torch.Tensor]


def send_shards(tensors: list[torch.Tensor], senders: list[int], receivers: list[int], *, rank: int, size: int,
                alltoall: AllToAll) -> None:
    """The senders' values (the same on each: they hold the world's state) into every receiver's
    `tensors`, one alltoall per device. Sender j (in rank order) sends byte range j of the state,
    so the senders share the work; ranks that hold the state already receive nothing. Every rank
    calls it with the same `senders` and `receivers`."""
    assert senders and not set(senders) & set(receivers), (senders, receivers)
    senders = sorted(senders)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for i, (device, ts) in enumerate(sorted(by_device.items(), key=lambda kv: str(kv[0]))):
        layout = _byte_layout(ts)
        total = sum(n for _, _, n in layout)
        splits, incoming = [0] * size, [0] * size
        bounds = shard_bounds(total, len(senders))
        if rank in receivers:
            for j, sender in enumerate(senders):
                incoming[sender] = bounds[j][1] - bounds[j][0]
        if rank in senders:
            lo, hi = bounds[senders.index(rank)]
            shard = _shard(layout, lo, hi)
            payload = torch.cat(shard * len(receivers)) if receivers and hi > lo else \
                torch.empty(0, dtype=torch.uint8, device=device)
            for r in receivers:
                splits[r] = hi - lo
        else:
            payload = torch.empty(0, dtype=torch.uint8, device=device)
        received = alltoall(payload, splits, incoming, i)
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


def prime_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's per-parameter state with a zero-LR step, then zero it.

    Horovod's optimizer-state broadcast runs a real `optimizer.step()` on any rank whose state is
    empty (a fresh worker joining), which would apply weight decay to its parameters; with state
    already present it only broadcasts.
    """
    if optimizer.state_dict()["state"]:
        return
    saved = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, saved):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    # Now as after no step at all: SGD's first momentum would hold weight decay x params, Adam's
    # step count 1 would change its first bias correction (a zero buffer is what SGD starts from).
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                value.zero_()
