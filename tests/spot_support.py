"""Shared by the spot-watcher tests: collects delivered notices with their arrival times."""

from __future__ import annotations

import threading
import time

from elasticyolo.spot import Notice, NoticeWatcher
from elasticyolo.local_cluster.wait import wait_for


class Collector(list):  # type: ignore[type-arg]
    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []
        self.lock = threading.Lock()

    def __call__(self, notice: Notice) -> None:
        with self.lock:
            self.append(notice)
            self.times.append(time.monotonic())

    def wait(self, n: int = 1, timeout: float = 5.0) -> list[Notice]:
        """The notices once at least `n` arrived (AssertionError after `timeout`)."""
        return wait_for(lambda: list(self) if len(self) >= n else None, timeout, f"{n} notice(s)", interval=0.01)


def polls_pass(watcher: NoticeWatcher, n: int = 3, timeout: float = 5.0) -> None:
    """Until every source of `watcher` has answered `n` more polls: a check that nothing (more)
    was delivered spans real polls, not a guessed time."""
    for i in range(n):
        since = time.time()
        wait_for(lambda: all((h.last_ok or 0.0) > since for h in watcher.health.values()), timeout,
                 f"poll {i + 1} of {n} of every notice source")
