"""The torch launcher stops a round's old workers while the next round forms
(`engines/torch/stop_overlap.py`): the stop returns at once, the leaving workers drop to the lowest
CPU priority, and the next round's workers start only once the old ones have exited."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

pytest.importorskip("torch")

from elasticyolo.engines.torch import stop_overlap  # noqa: E402


class _Handler:
    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc


class _Context:
    """torch's `PContext.close` as far as the overlap uses it: SIGTERM, wait for the exit."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.subprocess_handlers = {0: _Handler(proc)}
        self.closed_at: float | None = None

    def close(self, death_sig: signal.Signals, timeout: float) -> None:
        proc = self.subprocess_handlers[0].proc
        os.killpg(proc.pid, death_sig)
        proc.wait(timeout)
        self.closed_at = time.monotonic()


class _Agent:
    def __init__(self, ctx: _Context) -> None:
        self._pcontext: Any = ctx
        self.shutdowns = 0

    def _shutdown(self) -> None:
        self.shutdowns += 1


def test_the_stop_returns_at_once_and_the_next_start_waits_for_the_exit() -> None:
    # A worker that takes 0.5 s to leave after SIGTERM (as one finishing its snapshot does).
    child = ("import signal, sys, time\n"
             "signal.signal(signal.SIGTERM, lambda *_: (time.sleep(0.5), sys.exit(0)))\n"
             "print('up', flush=True)\n"
             "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"up"
        ctx = _Context(proc)
        agent = _Agent(ctx)
        t0 = time.monotonic()
        stop_overlap._stop_workers(agent, None)
        assert time.monotonic() - t0 < 0.3  # the rendezvous need not wait for the exit
        assert agent._pcontext is None and agent.shutdowns == 1
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == stop_overlap.LEAVING_NICE
        assert proc.poll() is None  # still leaving
        stop_overlap.wait_stopped(agent)  # what the next round's start does first
        assert proc.poll() is not None and ctx.closed_at is not None
        stop_overlap.wait_stopped(agent)  # nothing pending: returns at once
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_a_leaving_process_already_gone_is_no_error() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    proc.wait()
    stop_overlap.yield_cpu(proc.pid)  # logged, not raised


def test_install_patches_torchs_agent_once() -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    before = (LocalElasticAgent._stop_workers, LocalElasticAgent._start_workers, LocalElasticAgent._shutdown)
    code = ("from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent as A\n"
            "from elasticyolo.engines.torch import stop_overlap as s\n"
            "s.install(); first = (A._stop_workers, A._start_workers, A._shutdown)\n"
            "s.install(); assert first == (A._stop_workers, A._start_workers, A._shutdown)\n"
            "assert A._stop_workers is s._stop_workers\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)  # not in this process
    assert (LocalElasticAgent._stop_workers, LocalElasticAgent._start_workers,
            LocalElasticAgent._shutdown) == before


def test_a_launcher_stopping_for_good_marks_its_member_left_before_its_workers_stop() -> None:
    """A spot notice's SIGTERM: the other nodes re-form without waiting for this node's workers to
    reach their commit (`stop_at_commit.py`), or for its lease when it is killed first."""
    from types import SimpleNamespace

    order: list[str] = []
    handler = SimpleNamespace(_membership_leave=lambda: order.append("left"))
    ctx = SimpleNamespace(close=lambda *a, **k: order.append("workers stopped"))
    agent = SimpleNamespace(_pcontext=ctx, _worker_group=SimpleNamespace(spec=SimpleNamespace(rdzv_handler=handler)))
    stop_overlap.leave_first(agent)
    ctx.close()
    assert order == ["left", "workers stopped"]
    # A round's restart (`_stop_workers`) is not a leave: it clears the context before the shutdown.
    stop_overlap.leave_first(SimpleNamespace())  # no worker group: nothing to mark, no error
