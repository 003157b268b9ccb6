"""The source interface every provider implements, plus the shared HTTP plumbing."""

from __future__ import annotations

import abc
from typing import Any

import requests

from elasticyolo.log import get_logger
from elasticyolo.spot.notice import Notice


class MetadataError(Exception):
    """A transient metadata failure (5xx, timeout, refused, bad token): retried, never fatal."""


class NoticeSource(abc.ABC):
    """One thing that can announce an interruption; polled by NoticeWatcher in its own thread.

    Subclasses implement `_check()`, returning every notice currently visible (repeats are fine);
    `poll_once()` drops the ones already returned so each notice comes out exactly once.
    `_check()` raises MetadataError on a transient failure.
    """

    name = "source"

    def __init__(self, poll_interval_s: float) -> None:
        self.poll_interval_s = poll_interval_s
        self._seen: set[str] = set()
        self.log = get_logger("elasticyolo.spot", source=self.name)

    @abc.abstractmethod
    def _check(self) -> list[Notice]: ...

    def poll_once(self) -> list[Notice]:
        """One poll step: new notices only. Raises MetadataError on a transient failure."""
        fresh = []
        for notice in self._check():
            if notice.key not in self._seen:
                self._seen.add(notice.key)
                fresh.append(notice)
        return fresh

    def next_delay(self, elapsed: float) -> float:
        """Seconds to wait before the next poll, given how long this one took."""
        return self.poll_interval_s - elapsed

    def acknowledge(self, notice: Notice) -> bool:
        """Tell the provider we are done with the notice (only Azure has this). True on success."""
        return True

    def instance_type(self) -> str | None:
        """The VM's instance type as the provider's metadata states it (None: this source has no
        metadata service, or it does not say). Raises MetadataError on a transient failure."""
        return None

    def close(self) -> None:
        """Release resources; may be called from another thread to end a blocking poll early."""


class HttpSource(NoticeSource):
    """A source that talks HTTP to a metadata service at `base_url`."""

    def __init__(self, base_url: str, poll_interval_s: float, timeout_s: float) -> None:
        super().__init__(poll_interval_s)
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = requests.Session()
        # Metadata lives on a link-local address: never route it through HTTP(S)_PROXY from env.
        self.session.trust_env = False
        self.log = self.log.bind(url=self.base_url)

    def request(self, method: str, path: str, timeout: float | None = None, **kw: Any) -> requests.Response:
        """One HTTP request; connection errors and timeouts become MetadataError."""
        t = self.timeout_s if timeout is None else timeout
        try:
            # Short connect timeout: a metadata server answers on loopback/link-local or not at all.
            return self.session.request(method, self.base_url + path, timeout=(min(t, 2.0), t), **kw)
        except requests.RequestException as exc:
            raise MetadataError(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    @staticmethod
    def fail(resp: requests.Response, what: str) -> MetadataError:
        return MetadataError(f"{what}: HTTP {resp.status_code} {resp.text[:200]!r}")

    def close(self) -> None:
        self.session.close()
