"""Engine names -> engines. Torch-free and cheap: specs validate their `engine` here.

Where engines come from, later ones winning on a name clash:
1. the built-ins below;
2. the `elasticyolo.engines` entry-point group (`name = "package.module:ENGINE"`), for engines
   shipped in their own package;
3. `$ELASTICYOLO_ENGINES`: `name=module:attr[,name=module:attr...]`, for an engine on the
   PYTHONPATH (development, tests). Agents, `submit` and workers must all see the same setting.

Only names are read eagerly; an engine's module is imported when the engine is first used.
This module imports nothing of elasticyolo's but its errors: `spec.py` validates `engine` here.
`get()` returns an `engines.base.Engine` (typed `Any`: it is loaded from a string).
"""

from __future__ import annotations

import importlib
import os
from functools import lru_cache
from typing import Any

from elasticyolo.errors import UserError

ENV_ENGINES = "ELASTICYOLO_ENGINES"
ENTRY_POINT_GROUP = "elasticyolo.engines"
BUILTIN = {
    "horovod": "elasticyolo.engines.horovod.engine:ENGINE",
    "torch": "elasticyolo.engines.torch.engine:ENGINE",
}


@lru_cache(maxsize=8)
def _sources(env_value: str) -> dict[str, str]:
    found = dict(BUILTIN)
    try:
        from importlib.metadata import entry_points

        found.update({ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)})
    except Exception:  # noqa: BLE001 - broken package metadata must not hide the built-ins
        pass
    for item in filter(None, (p.strip() for p in env_value.split(","))):
        name, sep, target = item.partition("=")
        if not sep or ":" not in target:
            raise UserError(f"{ENV_ENGINES}: expected name=module:attr, got {item!r}")
        found[name.strip()] = target.strip()
    return found


def sources() -> dict[str, str]:
    """name -> "module:attr" of every known engine."""
    return _sources(os.environ.get(ENV_ENGINES, ""))


def names() -> list[str]:
    return list(sources())


def check_engine_name(name: str) -> str:
    """`name` if an engine of that name is known; ValueError listing the known ones otherwise."""
    known = names()
    if name not in known:
        quoted = [repr(n) for n in known]
        choices = quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " or " + quoted[-1]
        raise ValueError(f"Input should be {choices}")
    return name


@lru_cache(maxsize=16)
def _load(target: str) -> Any:
    module, _, attr = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def get(name: str) -> Any:
    """The engine called `name` (its module is imported now). UserError when unknown or broken."""
    try:
        check_engine_name(name)
    except ValueError as exc:
        raise UserError(f"engine {name!r}: {exc}") from None
    target = sources()[name]
    try:
        engine = _load(target)
    except (ImportError, AttributeError) as exc:
        raise UserError(f"engine {name!r} ({target}) cannot be loaded: {exc}") from None
    if getattr(engine, "name", None) != name:
        raise UserError(f"engine {name!r} ({target}) calls itself {getattr(engine, 'name', None)!r}")
    return engine
