"""The engine registry's table: engine names -> where each engine's object is ("module:attr").
Torch-free and cheap, and below everything that reads a spec: `spec.py` validates `engine` here.
Loading an engine, and checking it is one, is `registry.py`'s.

Where engines come from, later ones winning on a name clash:
1. the built-ins below;
2. the `elasticyolo.engines` entry-point group (`name = "package.module:ENGINE"`), for engines
   shipped in their own package;
3. `$ELASTICYOLO_ENGINES`: `name=module:attr[,name=module:attr...]`, for an engine on the
   PYTHONPATH (development, tests). Agents, `submit` and workers must all see the same setting;
4. `registry.register(engine)`, in this process only.
"""

from __future__ import annotations

import os
from functools import lru_cache

from elasticyolo.errors import UserError

ENV_ENGINES = "ELASTICYOLO_ENGINES"
ENTRY_POINT_GROUP = "elasticyolo.engines"
BUILTIN = {
    "horovod": "elasticyolo.engines.horovod.engine:ENGINE",
    "torch": "elasticyolo.engines.torch.engine:ENGINE",
    "ray": "elasticyolo.engines.ray.engine:ENGINE",
}
DEFAULT = "torch"  # the spec's `engine` when it names none: maintained upstream, nothing to build
_in_process: dict[str, str] = {}  # name -> where, by `registry.register()`


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
    return {**_sources(os.environ.get(ENV_ENGINES, "")), **_in_process}


def add(name: str, where: str) -> None:
    """A name registered in this process (`registry.register`)."""
    _in_process[name] = where


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
