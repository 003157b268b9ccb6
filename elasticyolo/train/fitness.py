"""Ultralytics' model selection: fitness of a validation, the best epoch, and early stopping.

Pure functions over the per-epoch metrics history (`Progress.history`), so every rank of an
elastic world reaches the same decision from the same (gathered) validation results.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence


def fitness(metrics: Mapping[str, Any]) -> float | None:
    """Ultralytics 8.4's detection fitness: mAP50-95 (`DetMetrics.fitness`, weights 0,0,0,1).
    None when the epoch was not validated."""
    value = metrics.get("mAP50-95")
    return None if value is None else float(value)


def best_epoch(history: Sequence[Mapping[str, Any]]) -> tuple[int, float] | None:
    """(epoch, fitness) of the best validated epoch; a later epoch wins a tie, as Ultralytics'
    `EarlyStopping` (`fitness >= best_fitness`)."""
    best: tuple[int, float] | None = None
    for rec in history:
        f = fitness(rec)
        if f is not None and (best is None or f >= best[1]):
            best = (int(rec["epoch"]), f)
    return best


def should_stop(history: Sequence[Mapping[str, Any]], patience: int) -> bool:
    """Ultralytics' `EarlyStopping`: stop once `patience` epochs passed without a better fitness.
    patience 0 never stops."""
    if patience <= 0 or not history:
        return False
    best = best_epoch(history)
    if best is None:
        return False
    last = int(history[-1]["epoch"])
    return last - best[0] >= patience
