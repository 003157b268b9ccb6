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


class ParentWatch:
    """Exit-when-orphaned check for a helper: its parent (the fork server) and the training
    process that owns it must both still exist."""

    def __init__(self, owner_pid: int) -> None:
        self.owner_pid = owner_pid
        self.parent_pid = os.getppid()

    def alive(self) -> bool:
        if os.getppid() != self.parent_pid:
            return False
        try:
            os.kill(self.owner_pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


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


__all__ = ["PRELOAD", "ParentWatch", "adopt_environment", "helper_context", "single_threaded"]
