"""The multiprocessing context for a training process's helper processes (data loader workers,
the checkpoint uploader).

`forkserver`: a clean single-purpose server process is started once (fork+exec, safe from a
process that already runs Horovod/Gloo/NCCL threads) and imports torch, Ultralytics' data code
and the checkpoint code once; every helper is forked from it, so a helper starts in
milliseconds without forking the threaded training process itself. Helpers watch their owner
(the training process that started them) and their parent (the fork server) and exit when
either goes away.

A worker forked from a zygote (worker_runtime/zygote.py) shares the zygote's fork server instead
(`fork_shared_fork_server`): forked, not exec'd, from the zygote, which holds the imports
already. torch elastic replaces every worker at every change; a server of each new rank 0's own would
import torch again (about 3.5 CPU-s on the node's host, while a joiner starts).
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import types
from multiprocessing.context import BaseContext
from typing import Any, Callable, Sequence

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
    _adopt_inherited_fork_server()
    return _ctx


def fork_shared_fork_server(close: Sequence[int] = (), in_server: Callable[[], None] | None = None) -> int:
    """Fork the helpers' fork server from this process, for every process forked from it later
    (a zygote's workers). Call from a single-threaded process that has imported torch: the server
    then starts with everything `PRELOAD` needs and imports nothing. `close`: descriptors the
    server must not hold (the zygote's pool socket). `in_server` runs first in the server (its
    lifeline). Returns the server's pid."""
    from multiprocessing import connection, forkserver

    from elasticyolo.processes import fork_child

    helper_context()
    for module in PRELOAD:
        importlib.import_module(module)
    listener = socket.socket(socket.AF_UNIX)
    address = connection.arbitrary_address("AF_UNIX")
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    alive_r, alive_w = os.pipe()  # every client holds the write end; all gone: the server exits

    def serve() -> None:
        os.close(alive_w)
        for fd in close:
            os.close(fd)
        if in_server is not None:
            in_server()
        forkserver.main(listener.fileno(), alive_r, [])

    pid = fork_child(serve, clean_exits=(SystemExit,))  # forkserver.main ends in SystemExit
    listener.close()
    os.close(alive_r)
    fs: Any = forkserver._forkserver  # type: ignore[attr-defined]
    fs._forkserver_address, fs._forkserver_alive_fd, fs._forkserver_pid = address, alive_w, pid
    return pid


_checked_in: int | None = None  # the process that last looked for an inherited fork server


def _adopt_inherited_fork_server() -> None:
    """In a process forked after `fork_shared_fork_server`: multiprocessing checks its server
    with `waitpid`, which fails for a server that is not this process's child. Check it by pid
    instead, and start one of our own only when it is gone."""
    global _checked_in
    if _checked_in == os.getpid():
        return
    _checked_in = os.getpid()
    from multiprocessing import forkserver

    fs: Any = forkserver._forkserver  # type: ignore[attr-defined]
    pid = fs._forkserver_pid
    if pid is None:
        return
    try:
        os.waitpid(pid, os.WNOHANG)
        return  # our own child: multiprocessing's check works
    except ChildProcessError:
        pass
    fs.ensure_running = types.MethodType(_ensure_inherited_running, fs)


def _ensure_inherited_running(fs: Any) -> None:
    from multiprocessing import resource_tracker
    from multiprocessing.forkserver import ForkServer

    from elasticyolo.processes import running

    with fs._lock:
        resource_tracker.ensure_running()
        if fs._forkserver_pid is not None and running(fs._forkserver_pid):
            return
        # Gone (with its zygote): forget it and start one of our own, as multiprocessing would.
        if fs._forkserver_alive_fd is not None:
            os.close(fs._forkserver_alive_fd)
        fs._forkserver_address = fs._forkserver_alive_fd = fs._forkserver_pid = None
        del fs.ensure_running
    ForkServer.ensure_running(fs)


# Where a fork server goes once started: a simulated node (train/sim_accelerator.py) moves it to
# the node's host side. Unset in a real deployment.
place_fork_server: Callable[[int], None] | None = None


def start_fork_server() -> None:
    """Start the fork server now (its imports run in parallel with whatever this process does
    next) instead of at the first helper's start."""
    from multiprocessing import forkserver

    helper_context()
    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    server.ensure_running()  # the instance's: an inherited server's check (the module alias is not)
    pid = server._forkserver_pid
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


__all__ = ["PRELOAD", "ParentWatch", "adopt_environment", "fork_shared_fork_server", "helper_context",
           "single_threaded", "start_fork_server"]
