"""The one wait helper of tests, benchmarks and the demo: scenarios wait on conditions, never on
fixed sleeps, and a timeout names what was awaited."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05,
             abort: Callable[[], str | None] | None = None) -> T:
    """Poll `condition` until it returns something truthy and return that; AssertionError naming
    `what` on timeout. Exceptions inside the condition count as "not yet" (etcd may be electing;
    a file may be half written) and the last one is reported. `abort()` returning a reason (e.g.
    "the job's process exited with 1") fails at once."""
    deadline = time.monotonic() + timeout
    last_exc: Exception | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001
            last_exc = exc
        reason = abort() if abort is not None else None
        if reason:
            raise AssertionError(f"{reason} while waiting for {what}")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}"
                                 + (f" (last error: {last_exc})" if last_exc else ""))
        time.sleep(interval)
