"""NoticeWatcher: runs notice sources in threads and delivers each notice once to a callback."""

from __future__ import annotations

import queue
import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable, Iterable

from tenacity import retry, retry_if_exception_type, stop_after_delay, wait_exponential

from elasticyolo.log import get_logger
from elasticyolo.spot.base import MetadataError, NoticeSource
from elasticyolo.spot.local import DEFAULT_SIGNAL_NOTICE_S, signal_notice
from elasticyolo.spot.notice import Notice

OnNotice = Callable[[Notice], None]


@dataclass
class SourceHealth:
    failures: int = 0  # consecutive
    last_ok: float | None = None  # epoch s
    last_error: str | None = None


class NoticeWatcher:
    """Polls every source in its own daemon thread (a GCP long-poll must not delay the others) and
    hands notices to `on_notice` from one dispatcher thread, in order, each key exactly once.

    Transient failures are logged and retried with exponential backoff capped at `max_backoff_s`;
    nothing a source raises stops the watcher. `inject()` is safe to call from a signal handler.
    """

    def __init__(
        self,
        sources: Iterable[NoticeSource] = (),
        *,
        provider: str = "none",
        max_backoff_s: float = 5.0,
        signal_deadline_s: float = DEFAULT_SIGNAL_NOTICE_S,
    ) -> None:
        self.sources = list(sources)
        self.provider = provider
        self.max_backoff_s = max_backoff_s
        self.signal_deadline_s = signal_deadline_s
        self.health = {s.name: SourceHealth() for s in self.sources}
        self.log = get_logger("elasticyolo.spot", provider=provider)
        # SimpleQueue.put is reentrant: the one primitive safe to use inside a signal handler.
        self._queue: queue.SimpleQueue[tuple[Notice, NoticeSource | None] | None] = queue.SimpleQueue()
        self._delivered: dict[str, Notice] = {}
        self._origin: dict[str, NoticeSource] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # -- public API ----------------------------------------------------------------------------
    @property
    def notices(self) -> list[Notice]:
        """Every notice delivered so far, oldest first."""
        with self._lock:
            return list(self._delivered.values())

    @property
    def running(self) -> bool:
        return bool(self._threads) and not self._stop.is_set()

    def start(self, on_notice: OnNotice) -> None:
        if self._threads:
            raise RuntimeError("NoticeWatcher already started")
        self._stop.clear()
        self._threads = [threading.Thread(target=self._dispatch, args=(on_notice,), name="spot-dispatch", daemon=True)]
        self._threads += [
            threading.Thread(target=self._poll_loop, args=(s,), name=f"spot-{s.name}", daemon=True)
            for s in self.sources
        ]
        for t in self._threads:
            t.start()
        self.log.info("notice watcher started", sources=[s.name for s in self.sources])

    def stop(self, timeout: float = 5.0) -> None:
        """Stop polling; notices already queued are still delivered. Threads are daemons, so a
        poll stuck in a long-poll past `timeout` cannot keep the process alive."""
        self._stop.set()
        if self._threads:
            self._queue.put(None)  # wakes the dispatcher after what is already queued
        for s in self.sources:
            s.close()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads = []

    def poll_once(self) -> list[Notice]:
        """Poll each source once and take injected notices, synchronously, without a callback.
        For tests and one-shot checks; do not mix with start()."""
        fresh: list[Notice] = []
        for s in self.sources:
            if (notices := self._poll_source(s)) is None:
                continue
            fresh += [n for n in notices if self._accept(n, s)]
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None and self._accept(*item):
                fresh.append(item[0])
        return fresh

    def inject(self, notice: Notice) -> None:
        """Queue a notice from outside (signal handler, agent, tests); delivered once like others."""
        self._queue.put((notice, None))

    def inject_signal(self, signum: int, deadline_in_s: float | None = None) -> None:
        """What the agent's SIGTERM handler calls. Signal-safe."""
        self.inject(signal_notice(signum, self.signal_deadline_s if deadline_in_s is None else deadline_in_s))

    def install_signal_handlers(self, signums: Iterable[int] = (signal.SIGTERM,)) -> dict[int, Any]:
        """Turn the given signals into notices (main thread only). Returns the previous handlers.
        The agent may instead call inject_signal() from its own handler."""
        previous: dict[int, Any] = {}

        def handler(signum: int, _frame: FrameType | None) -> None:
            self.inject_signal(signum)

        for signum in signums:
            previous[signum] = signal.signal(signum, handler)
        return previous

    def acknowledge(self, notice: Notice) -> bool:
        """Tell the provider the node is drained (Azure approves the event; others: no-op)."""
        with self._lock:
            source = self._origin.get(notice.key)
        return source.acknowledge(notice) if source is not None else True

    def instance_type(self, within_s: float = 10.0) -> str | None:
        """The instance type the cloud's metadata states (first source that says), asked once at
        agent start; transient failures are retried for `within_s`, then None (logged)."""
        ask = retry(retry=retry_if_exception_type(MetadataError), stop=stop_after_delay(within_s),
                    wait=wait_exponential(multiplier=0.2, max=2.0), reraise=True)
        for source in self.sources:
            try:
                itype = ask(source.instance_type)()
            except MetadataError as exc:
                self.log.warning("instance type: metadata did not answer", source=source.name, error=str(exc)[:200])
                continue
            if itype:
                return itype
        return None

    def status(self) -> dict[str, Any]:
        """For `elasticyolo status`: provider, per-source health and notices so far."""
        return {
            "provider": self.provider,
            "sources": {name: vars(h).copy() for name, h in self.health.items()},
            "notices": [n.to_dict() for n in self.notices],
        }

    # -- internals -----------------------------------------------------------------------------
    def _accept(self, notice: Notice, source: NoticeSource | None) -> bool:
        with self._lock:
            if notice.key in self._delivered:
                return False
            self._delivered[notice.key] = notice
            if source is not None:
                self._origin[notice.key] = source
        return True

    def _poll_source(self, source: NoticeSource) -> list[Notice] | None:
        """One guarded poll: None on failure (logged, counted), never raises."""
        health = self.health.setdefault(source.name, SourceHealth())
        try:
            notices = source.poll_once()
        except Exception as exc:  # noqa: BLE001 - a watcher must never die of a metadata hiccup
            health.failures += 1
            health.last_error = f"{type(exc).__name__}: {exc}"
            if health.failures <= 3 or health.failures % 20 == 0:
                self.log.warning("notice poll failed, retrying", source=source.name,
                                 failures=health.failures, error=health.last_error)
            return None
        if health.failures:
            self.log.info("notice poll recovered", source=source.name, after_failures=health.failures)
        health.failures, health.last_ok, health.last_error = 0, time.time(), None
        for n in notices:
            self.log.warning("interruption notice", source=source.name, kind=n.kind, drain=n.drain,
                             seconds_left=round(n.seconds_left(), 1), key=n.key)
        return notices

    def _poll_loop(self, source: NoticeSource) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            notices = self._poll_source(source)
            if notices is None:
                failures = self.health[source.name].failures
                delay = min(source.poll_interval_s * 2 ** min(failures - 1, 16), max(self.max_backoff_s, source.poll_interval_s))
            else:
                for n in notices:
                    self._queue.put((n, source))
                # A long-poll already waited: the source says what is left to sleep.
                delay = source.next_delay(time.monotonic() - t0)
            if delay > 0:
                self._stop.wait(delay)

    def _dispatch(self, on_notice: OnNotice) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            notice, source = item
            if not self._accept(notice, source):
                continue
            if source is None:
                self.log.warning("interruption notice", source="injected", kind=notice.kind,
                                 drain=notice.drain, seconds_left=round(notice.seconds_left(), 1), key=notice.key)
            try:
                on_notice(notice)
            except Exception:  # noqa: BLE001 - a broken callback must not stop later notices
                self.log.exception("on_notice callback failed", key=notice.key)
