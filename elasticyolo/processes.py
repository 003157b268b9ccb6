"""Process helpers without torch: whether a process is still running, by pid (for processes this
one did not start), a process and everything under it, a signal to many processes at once, and
forking a child that never returns into its parent's code."""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

import psutil


def running(pid: int) -> bool:
    """`pid` exists and is not a zombie (an exited child its parent has not reaped yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def process_tree(pid: int) -> list[int]:
    """`pid` and every process under it; [] once it is gone."""
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def signal_each(pids: list[int], sig: int) -> None:
    """`sig` to each of `pids`, one right after another (those already gone are skipped)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def fork_child(run: Callable[[], object], *, clean_exits: tuple[type[BaseException], ...] = ()) -> int:
    """Fork; the child runs `run()` and always ends in `os._exit`, never returning into the
    caller's code or its exit hooks: 0 when `run` returns (or raises one of `clean_exits`), 1
    after printing any other exception. Flushes the standard streams first so that nothing
    buffered is written twice. Returns the child's pid (in the parent)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            try:
                run()
            except clean_exits:
                pass
            code = 0
        except BaseException:  # noqa: BLE001 - never return into the forking process's code
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid
