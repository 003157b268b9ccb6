"""A round's old workers stop while the next round forms, not before it.

torch's agent restarts a round in sequence: stop the workers (SIGTERM, wait for them to exit),
rendezvous, start the next round's workers. The stop takes up to a commit interval (the workers
train on to their next commit, `stop_at_commit.py`, and its loader processes exit) and the
rendezvous 0.3-0.8 s on 2 cores; nothing in the rendezvous needs the old workers gone. Only the next round's
workers must not start before the old ones are: they read the snapshot the old ones finish.

`install()` (in the launcher process only) replaces `LocalElasticAgent._stop_workers` by one that
signals the workers as torch does and leaves the wait (and torch's SIGKILL after its timeout) to a
thread, and makes `_start_workers` join that thread first. Everything else is torch's `close`.
A final `_shutdown` (SIGTERM, the job's end) marks the launcher's rendezvous member left before it
stops the workers (`leave_first`).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from elasticyolo.log import get_logger

log = get_logger("elasticyolo.torch.stop")

STOP_TIMEOUT_S = 30  # torch's own default for a worker to exit after SIGTERM, before SIGKILL
LEAVING_NICE = 19

_PENDING = "_elasticyolo_pending_stop"  # on the agent: the thread stopping its old workers
_INSTALLED = "_elasticyolo_stop_overlap"  # on the class


def _stop_workers(agent: Any, *_args: Any, **_kwargs: Any) -> None:
    old = agent._pcontext
    agent._pcontext = None
    agent._shutdown()  # torch's watchdog and health-check server; no workers to close now
    if old is None:
        return
    for handler in getattr(old, "subprocess_handlers", {}).values():
        yield_cpu(handler.proc.pid)
    stopping = threading.Thread(target=old.close, args=(signal.SIGTERM, STOP_TIMEOUT_S),
                                name="stop-old-workers", daemon=True)
    stopping.start()
    setattr(agent, _PENDING, stopping)


def yield_cpu(pgid: int) -> None:
    """The leaving worker's process group (the worker, its loader processes) runs its last work at
    the lowest priority: on 2 cores it otherwise takes half the CPU from the rendezvous and the
    next round's restore (seen: a torch rendezvous op of 0.3-0.8 s beside two dying workers).
    Raising a nice value needs no privilege."""
    try:
        os.setpriority(os.PRIO_PGRP, pgid, LEAVING_NICE)
    except OSError as exc:  # already gone, or not ours
        log.debug("could not lower a leaving worker's priority", pgid=pgid, error=str(exc))


def wait_stopped(agent: Any) -> None:
    """Block until the previous round's workers have exited (SIGKILLed after the timeout)."""
    stopping: threading.Thread | None = getattr(agent, _PENDING, None)
    if stopping is not None:
        stopping.join()
        setattr(agent, _PENDING, None)


def leave_first(agent: Any) -> None:
    """A launcher that stops for good (a spot notice's SIGTERM) marks its rendezvous member left
    before its workers stop, not after: they train on to their next commit (`stop_at_commit.py`),
    and the other nodes' next round need not wait for that, nor, when the node is killed at its
    notice's deadline first, for its lease to expire (seen in a replay: 2.1 s with no round)."""
    handler = getattr(getattr(getattr(agent, "_worker_group", None), "spec", None), "rdzv_handler", None)
    leave = getattr(handler, "_membership_leave", None)  # membership.py
    if leave is not None:
        leave()


def install() -> None:
    if getattr(LocalElasticAgent, _INSTALLED, False):
        return
    start = LocalElasticAgent._start_workers
    shutdown = LocalElasticAgent._shutdown

    def start_workers(agent: Any, *args: Any, **kwargs: Any) -> Any:
        wait_stopped(agent)
        return start(agent, *args, **kwargs)

    def shutdown_all(agent: Any, *args: Any, **kwargs: Any) -> None:
        if agent._pcontext is not None:  # this launcher stops for good (`_stop_workers` clears it)
            leave_first(agent)
        shutdown(agent, *args, **kwargs)
        wait_stopped(agent)  # leaving (job done, SIGTERM): no worker outlives the launcher's wait

    LocalElasticAgent._stop_workers = _stop_workers  # type: ignore[method-assign]
    LocalElasticAgent._start_workers = start_workers  # type: ignore[method-assign]
    LocalElasticAgent._shutdown = shutdown_all  # type: ignore[method-assign]
    setattr(LocalElasticAgent, _INSTALLED, True)
