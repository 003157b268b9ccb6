"""Exit hooks that belong to the process that registered them.

`atexit` handlers are inherited by a child forked without exec, and a zygote's worker runs its
inherited handlers when it exits (as a fresh interpreter runs its own). A handler that closes a
loader pool, finishes a snapshot thread or leaves a rendezvous acts on objects of the process that
registered it: in a forked child it fails (or worse, leaves the parent's rendezvous). Every handler
elasticyolo registers goes through `at_exit`, which runs it only in the registering process.
"""

from __future__ import annotations

import atexit
import os
from typing import Any, Callable


def at_exit(func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """`atexit.register(func, *args, **kwargs)`, skipped in a process forked after this call."""
    atexit.register(_in_process, os.getpid(), func, *args, **kwargs)


def _in_process(pid: int, func: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    if os.getpid() == pid:
        func(*args, **kwargs)
