"""Optimizers without `torch._dynamo`, for eager training.

torch imports `torch._dynamo` the first time an optimizer is built or stepped: `Optimizer`'s
`add_param_group`, `zero_grad`, `state_dict` and `load_state_dict` are wrapped by
`torch._disable_dynamo`, and every `step` by `_use_grad_for_differentiable`, both of which import it
lazily for what matters only under `torch.compile` (keeping dynamo out, two graph breaks). The
import costs 1.7 CPU-s (2-core x86-64 VM, torch 2.14), a third of what a worker process imports,
and it lies on the start-up path of every node that joins a world. Workers train eagerly and never
compile, so:

- `compile_free_optimizers()` (process-wide, idempotent) gives each of `Optimizer`'s
  `_disable_dynamo` wrappers its function as the "dynamo-disabled" version that the wrapper caches
  on its first call (`torch/_compile.py`): the wrapper then calls the function itself.
- `eager_step(optimizer)` binds, on one instance, the class's own step under `torch.no_grad()`
  inside torch's profiling and hook wrapper (`Optimizer.profile_hook_step`: step pre/post hooks, the
  profiler's record, the LR scheduler's call counter). An optimizer whose step is not wrapped so
  (another torch, a `differentiable` one, a class of its own) keeps its step.

Where torch changes these wrappers, both leave things as they are and the import happens as before.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch.optim import Optimizer

_USE_GRAD = "_use_grad_for_differentiable.<locals>._use_grad"
_DISABLE_DYNAMO = "_disable_dynamo.<locals>.inner"
_CACHE_ATTR = "__dynamo_disable"  # where torch/_compile.py's wrapper caches the disabled function


def _qualname(fn: Any) -> str:
    code = getattr(fn, "__code__", None)  # (functools.wraps copied the wrapped function's names)
    return "" if code is None else str(getattr(code, "co_qualname", code.co_name))


def compile_free_optimizers() -> int:
    """Make `Optimizer`'s `_disable_dynamo` wrappers call their functions directly. Returns how
    many it set (0 when torch has none, or they are set already)."""
    done = 0
    for attr in vars(Optimizer).values():
        inner = getattr(attr, "__wrapped__", None)
        if _qualname(attr) == _DISABLE_DYNAMO and callable(inner) and getattr(inner, _CACHE_ATTR, None) is None:
            setattr(inner, _CACHE_ATTR, inner)
            done += 1
    return done


def own_step(optimizer: Optimizer) -> Callable[..., Any] | None:
    """The class's own step under torch's wrappers, or None when they are not the known two."""
    hooked = type(optimizer).step
    use_grad = getattr(hooked, "__wrapped__", None)
    if use_grad is None or _qualname(use_grad) != _USE_GRAD:
        return None
    inner = getattr(use_grad, "__wrapped__", None)
    return inner if callable(inner) else None


def eager_step(optimizer: Optimizer) -> bool:
    """Give `optimizer` a step that does not import torch._dynamo. True when it got one."""
    if optimizer.defaults.get("differentiable", False):
        return False
    inner = own_step(optimizer)
    if inner is None:
        return False

    def no_grad_step(self: Optimizer, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return inner(self, *args, **kwargs)

    optimizer.step = types.MethodType(Optimizer.profile_hook_step(no_grad_step), optimizer)  # type: ignore[method-assign]
    return True
