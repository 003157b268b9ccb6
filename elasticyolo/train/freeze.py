"""Frozen layers, as Ultralytics' trainer freezes them (`freeze=`, engine/trainer.py).

`freeze=N` freezes layers 0..N-1 of the model (`model.0.` ... `model.N-1.`), a list freezes the
layers with those indices (a dotted name such as `22.cv2` part of one), and the DFL's fixed
projection (`.dfl`) is always frozen. A frozen parameter has `requires_grad=False`, so it gets no
gradient: the core leaves it out of the gradient all-reduce, clipping and the optimizer's step
(weight decay included), and it keeps its loaded value bit for bit. Its layer's BatchNorm modules
stay in eval mode whenever the model trains (`set_train_mode`), so their running statistics stay
too; saved, restored and synced state carries those values unchanged.
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from elasticyolo.errors import UserError

ALWAYS_FROZEN = (".dfl",)  # Ultralytics' trainer: `always_freeze_names`


def frozen_prefixes(freeze: int | Sequence[int | str] | None, layers: int) -> tuple[str, ...]:
    """The name prefixes `freeze` selects in a model of `layers` layers; a one-line UserError for
    layers that do not exist or a freeze that leaves nothing to train."""
    if freeze is None:
        return ()
    last = f"layers 0-{layers - 1}"
    if isinstance(freeze, int):
        if freeze >= layers:
            raise UserError(f"freeze={freeze}: the model has {layers} layers ({last}); freezing them all "
                            "leaves nothing to train")
        return tuple(f"model.{i}." for i in range(freeze))
    for item in freeze:
        index = int(str(item).split(".")[0])
        if index >= layers:
            raise UserError(f"freeze={list(freeze)}: layer {index} does not exist (the model has {last})")
    return tuple(f"model.{item}." for item in freeze)


def is_frozen(name: str, prefixes: Sequence[str]) -> bool:
    """Is parameter or module `name` frozen? (A module name is matched as `name.`.)"""
    return (name + ".").startswith(tuple(prefixes)) or any(f in name for f in ALWAYS_FROZEN)


def apply_freeze(model: nn.Module, prefixes: Sequence[str], where: str = "freeze") -> int:
    """Set `requires_grad` by `prefixes` (and ALWAYS_FROZEN). Returns how many parameter tensors
    are frozen by `prefixes`."""
    frozen = 0
    for name, p in model.named_parameters():
        stays = is_frozen(name, prefixes)
        p.requires_grad_(not stays)
        frozen += bool(prefixes) and (name + ".").startswith(tuple(prefixes))
    if not any(p.requires_grad for p in model.parameters()):
        raise UserError(f"{where}: every parameter of the model is frozen; nothing is left to train")
    return frozen


def frozen_norm_names(model: nn.Module, prefixes: Sequence[str]) -> list[str]:
    """The BatchNorm modules of the frozen layers (Ultralytics keeps them in eval mode)."""
    if not prefixes:
        return []
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and is_frozen(name, prefixes)]


def set_train_mode(model: nn.Module, frozen_norms: Sequence[str]) -> None:
    """`model.train()`, with the frozen layers' BatchNorm modules left in eval mode."""
    model.train()
    if frozen_norms:
        modules = dict(model.named_modules())
        for name in frozen_norms:
            modules[name].eval()
