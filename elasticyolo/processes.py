"""Whether a process is still running, by pid (for processes this one did not start)."""

from __future__ import annotations

import psutil


def running(pid: int) -> bool:
    """`pid` exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
