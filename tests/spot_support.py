"""Shared by the spot-watcher tests: collects delivered notices with their arrival times."""

from __future__ import annotations

import threading
import time

from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.spot import Notice


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
