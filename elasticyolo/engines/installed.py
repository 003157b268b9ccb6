"""What this node has installed for an engine, and whether its agent takes the engine's jobs.

An engine names the modules its workers need (`Engine.requires`) and what the operator installs
to get them (`Engine.install_hint`). `module_installed` is the one test of "installed here": the
module is found by the import system (`importlib.util.find_spec`), evaluated once per process. A
dotted name imports its parents, so `horovod.torch` runs Horovod's own `__init__` (a broken or
absent Horovod answers False) without importing torch or Horovod's torch extension: about a
millisecond, and the agent stays torch-free.
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache
from typing import Callable, Iterable, Protocol

# The node record field where an agent says why it does not run the job's engine (status shows it).
RECORD_FIELD = "refused"


class Requiring(Protocol):
    """The parts of an engine (`engines/base.py`) this module reads."""

    name: str
    requires: tuple[str, ...]
    install_hint: str


@lru_cache(maxsize=None)
def module_installed(name: str) -> bool:
    """Whether `name` can be imported on this node (found by the import system)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or has no __spec__
        return False


def refusal(engine_name: str, missing: Iterable[str], install_hint: str) -> str | None:
    """The one-line reason a node refuses an engine's job (None: it takes it). Pure."""
    missing = list(missing)
    if not missing:
        return None
    hint = f" ({install_hint})" if install_hint else ""
    return f"engine {engine_name} is not installed here{hint}"


def engine_refusal(engine: Requiring, installed: Callable[[str], bool] = module_installed) -> str | None:
    """Why this node cannot run `engine`'s workers, or None when everything it requires is here."""
    return refusal(engine.name, [m for m in engine.requires if not installed(m)], engine.install_hint)
