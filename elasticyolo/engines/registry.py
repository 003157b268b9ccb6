"""Engine names -> engines: `get(name)` loads the engine a spec names and checks it is one.

The names and where each engine's object is live in `names.py` (the spec validates `engine`
there, below everything else); only names are read eagerly, and an engine's module is imported
when the engine is first used. An object that lacks a required part of `engines.base.Engine` is
refused, when registered (`register`) or when first loaded by name (`get`), with one line naming
what it lacks.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Any

from elasticyolo.engines import names as table
from elasticyolo.engines.base import Engine, missing_parts
from elasticyolo.engines.names import (  # noqa: F401 - the registry's table, re-exported
    BUILTIN, DEFAULT, ENTRY_POINT_GROUP, ENV_ENGINES, check_engine_name, names, sources)
from elasticyolo.errors import UserError

_registered: dict[str, Engine] = {}  # by `register()`, in this process


@lru_cache(maxsize=16)
def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _checked(engine: Any, name: str, where: str) -> Engine:
    if not isinstance(engine, Engine):
        raise UserError(f"engine {name!r} ({where}) is refused: a {type(engine).__name__}, not an "
                        "elasticyolo.engines.base.Engine")
    missing = missing_parts(engine)
    if missing:
        raise UserError(f"engine {name!r} ({where}) is refused: it lacks {', '.join(missing)} (engines/base.py)")
    if engine.name != name:
        raise UserError(f"engine {name!r} ({where}) calls itself {engine.name!r}")
    return engine


def register(engine: Any, name: str | None = None) -> Engine:
    """Register `engine` in this process under `name` (default: its own `name`), after checking
    it has every required part. Agents, `submit` and workers that run in other processes find
    engines by `$ELASTICYOLO_ENGINES` or the entry points (`names.py`) instead."""
    where = f"{type(engine).__module__}.{type(engine).__qualname__}"
    name = name or getattr(engine, "name", None)
    if not isinstance(name, str) or not name:
        raise UserError(f"engine ({where}) is refused: it lacks name (engines/base.py)")
    _registered[name] = _checked(engine, name, where)
    table.add(name, where)
    return engine


def get(name: str) -> Engine:
    """The engine called `name` (its module is imported now). UserError when unknown, broken or
    not a whole `Engine`."""
    if name in _registered:
        return _registered[name]
    try:
        check_engine_name(name)
    except ValueError as exc:
        raise UserError(f"engine {name!r}: {exc}") from None
    target = sources()[name]
    try:
        engine = _load(target)
    except Exception as exc:  # noqa: BLE001 - a plug-in's import may fail any way; one line says how
        raise UserError(f"engine {name!r} ({target}) cannot be loaded: {exc}") from None
    return _checked(engine, name, target)
