"""The multiprocessing context for a training process's helper processes (data loader workers,
the checkpoint uploader).

`forkserver`: a clean single-purpose server process is started once (fork+exec, safe from a
process that already runs Horovod/Gloo/NCCL threads) and imports torch, Ultralytics' data code
and the checkpoint code once; every helper is forked from it, so a helper starts in
milliseconds without forking the threaded training process itself. Helpers watch their parent
(the fork server, which exits when the training process dies) and exit when it goes away.
"""

from __future__ import annotations

import os
from multiprocessing.context import BaseContext
from typing import Callable

# Imported once by the fork server, so each helper forked from it starts warm.
PRELOAD = ["elasticyolo.train.loader_worker", "elasticyolo.checkpoint.uploader"]

_ctx: BaseContext | None = None


def helper_context() -> BaseContext:
    """The shared context (torch's multiprocessing, so tensors travel as shared memory)."""
    global _ctx
    if _ctx is None:
        import torch.multiprocessing as tmp  # registers the tensor reductions with ForkingPickler

        ctx = tmp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        _ctx = ctx
    return _ctx


# Where a fork server goes once started: a simulated node (train/sim_accelerator.py) moves it to
# the node's host side. Unset in a real deployment.
place_fork_server: Callable[[int], None] | None = None


def start_fork_server() -> None:
    """Start the fork server now (its imports run in parallel with whatever this process does
    next) instead of at the first helper's start."""
    from multiprocessing import forkserver

    helper_context()
    forkserver.ensure_running()
    pid = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_pid", None)
    if pid is not None and place_fork_server is not None:
        place_fork_server(pid)


class ParentWatch:
    """Exit-when-orphaned for a helper. The owner is the training process that created it: the
    pipe multiprocessing keeps to it (`parent_process().sentinel`) closes when it dies, whatever
    killed it. The parent is the process this one was forked from (the fork server, or the
    loader host for a loader worker)."""

    def __init__(self) -> None:
        import multiprocessing

        owner = multiprocessing.parent_process()
        self.sentinel = owner.sentinel if owner is not None else None
        self.parent_pid = os.getppid()

    def alive(self) -> bool:
        from multiprocessing.connection import wait

        if os.getppid() != self.parent_pid:
            return False
        return self.sentinel is None or not wait([self.sentinel], timeout=0)

    def exit_with_owner(self) -> None:
        """A thread that ends this process as soon as the owner dies, even mid-work (for helpers
        that never fork)."""
        import threading
        from multiprocessing.connection import wait

        def watch() -> None:
            if self.sentinel is not None:
                wait([self.sentinel])
                os._exit(0)

        threading.Thread(target=watch, name="owner-watch", daemon=True).start()


def adopt_environment(env: dict[str, str]) -> None:
    """A helper forked from the fork server has the environment the training process had when
    the server started; this makes it the environment the training process has now (e.g. store
    credentials or endpoints set since)."""
    os.environ.clear()
    os.environ.update(env)


def single_threaded(threads: int = 1) -> None:
    """A helper does one thing at a time: keep torch/OpenCV from starting thread pools in it."""
    import torch

    torch.set_num_threads(threads)
    try:
        import cv2

        cv2.setNumThreads(0)
    except Exception:  # noqa: BLE001 - OpenCV is optional for the uploader
        pass


__all__ = ["PRELOAD", "ParentWatch", "adopt_environment", "helper_context", "single_threaded", "start_fork_server"]
