"""The one wait helper of tests, benchmarks and the demo: scenarios wait on conditions, never on
fixed sleeps, and a timeout names what was awaited."""

from __future__ import annotations

import threading
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def wait_for(condition: Callable[[], T], timeout: float, what: str, *, interval: float = 0.05,
             abort: Callable[[], str | None] | None = None, context: Callable[[], str] | None = None) -> T:
    """Poll `condition` until it returns something truthy and return that; AssertionError naming
    `what` on timeout. Exceptions inside the condition count as "not yet" (etcd may be electing;
    a file may be half written) and the last one is reported. `abort()` returning a reason (e.g.
    "the job's process exited with 1") fails at once. Either failure's message ends with
    `context()` where given (the scenario's logs, say)."""
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
            raise AssertionError(f"{reason} while waiting for {what}" + _context(context))
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:.1f}s waiting for {what}"
                                 + (f" (last error: {last_exc})" if last_exc else "") + _context(context))
        time.sleep(interval)


def _context(context: Callable[[], str] | None) -> str:
    return f"\n{context()}" if context is not None else ""


def in_threads(fn: Callable[[int], T], n: int, timeout: float) -> list[T | BaseException | None]:
    """Run `fn(0) .. fn(n-1)` concurrently (e.g. the ranks or agents of one round) and return their
    results in order: a raised exception in its place, None for one still running at `timeout`."""
    results: list[T | BaseException | None] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's assertions
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    return results
