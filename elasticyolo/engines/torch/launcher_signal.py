"""The launcher's stop signal is never lost.

torch's launcher stops by an exception: its signal handler raises `SignalException` on the main
thread wherever that thread is. Any `except Exception` on the way (an etcd read in a rendezvous
sync, a library's best-effort cleanup, logging's own handler) swallows it, and the launcher trains
on until the agent's SIGKILL: a node drained on a spot notice whose launcher swallows it trains on
to its drain deadline, and the survivor's next round never comes.

`install()` puts one handler in place of torch's (torch registers `_terminate_process_handler`
by name when it starts workers) and of the launcher's own for the first rendezvous; it records
the signal before raising. The agent's monitor loop (`check`, from the rendezvous handler's
`num_nodes_waiting`, on the main thread every monitor interval, never during a shutdown) raises
it again if it got lost: a swallowed stop costs one monitor interval, not the drain.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

from torch.distributed.elastic.multiprocessing import api as mp_api
from torch.distributed.elastic.multiprocessing.api import SignalException

from elasticyolo.log import get_logger

log = get_logger("elasticyolo.torch.launcher")

_received: signal.Signals | None = None


def on_signal(signum: int, _frame: FrameType | None) -> None:
    global _received
    _received = signal.Signals(signum)
    raise SignalException(f"launcher {os.getpid()} got {_received.name}", sigval=_received)


def install() -> None:
    """In the launcher process only, on its main thread."""
    mp_api._terminate_process_handler = on_signal  # type: ignore[assignment]
    signal.signal(signal.SIGTERM, on_signal)  # until torch registers its handlers (the first round)


def check() -> None:
    """Raise the stop signal again if one arrived and the launcher is still running its rounds."""
    if _received is not None and threading.current_thread() is threading.main_thread():
        log.warning("the launcher's stop signal was swallowed on the way; raising it again",
                    signal=_received.name)
        raise SignalException(f"launcher {os.getpid()} got {_received.name} (raised again)", sigval=_received)
