"""A CPU stand-in for `torch.cuda.make_graphed_callables`, for unit tests of `train/graphs.py`.

It keeps what the real capture does to the training loop: a few warm-up passes before capture
(they move BatchNorm's statistics), outputs and parameter gradients returned as detached views of
static buffers that the next call overwrites (so autograd adopts a gradient buffer as `.grad`
when `.grad` is None, exactly as with a replayed graph). It computes eagerly and reads the
parameters as they are now, so it cannot show a stale graph after the parameters move: the
tests check that a move captures again.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

WARMUP_PASSES = 3  # make_graphed_callables' num_warmup_iters default


def static_buffer_capture(body: nn.Module, sample: torch.Tensor) -> Callable[[torch.Tensor], Any]:
    params = tuple(body.parameters())
    with torch.no_grad():
        for _ in range(WARMUP_PASSES):
            body(sample)
    state: dict[str, Any] = {}

    class StaticBuffers(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, *_params: torch.Tensor) -> tuple[torch.Tensor, ...]:
            with torch.enable_grad():
                flat, spec = tree_flatten(body(x.detach()))
            state["outputs"], state["spec"] = flat, spec
            if "static_outputs" not in state:
                state["static_outputs"] = [torch.empty_like(o) for o in flat]
            for s, o in zip(state["static_outputs"], flat):
                s.copy_(o.detach())
            return tuple(s.detach() for s in state["static_outputs"])

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            trainable = [p for p in params if p.requires_grad]
            pairs = [(o, g) for o, g in zip(state["outputs"], grads) if o.requires_grad]
            found = torch.autograd.grad([o for o, _ in pairs], trainable, [g for _, g in pairs], allow_unused=True)
            if "static_grads" not in state:
                state["static_grads"] = [torch.empty_like(p) for p in trainable]
            for s, g in zip(state["static_grads"], found):
                s.copy_(g) if g is not None else s.zero_()
            by_param = iter(state["static_grads"])
            return (None, *(next(by_param).detach() if p.requires_grad else None for p in params))

    def replay(x: torch.Tensor) -> Any:
        out = StaticBuffers.apply(x, *params)
        return tree_unflatten(list(out), state["spec"])

    return replay
