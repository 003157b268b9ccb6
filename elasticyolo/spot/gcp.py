"""GCP preemption and host-maintenance notices through the metadata server (long-polls)."""

from __future__ import annotations

import math
import time

from elasticyolo.spot.base import HttpSource
from elasticyolo.spot.notice import GCP_MAINTENANCE_NOTICE_S, GCP_NOTICE_S, Notice

DEFAULT_URL = "http://metadata.google.internal"
PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
MAINTENANCE_PATH = "/computeMetadata/v1/instance/maintenance-event"
MACHINE_TYPE_PATH = "/computeMetadata/v1/instance/machine-type"
HEADERS = {"Metadata-Flavor": "Google"}


class GcpSource(HttpSource):
    """Watches one metadata key. With long_poll, each poll blocks server-side until the value
    changes (wait_for_change + last_etag, so no change is missed between polls) or until
    `poll_interval_s` passes; a notice thus arrives the moment the server sets it."""

    def __init__(
        self,
        key: str = "preempted",
        base_url: str = DEFAULT_URL,
        poll_interval_s: float = 5.0,
        timeout_s: float = 2.0,
        long_poll: bool = True,
    ) -> None:
        if key not in ("preempted", "maintenance-event"):
            raise ValueError("key must be 'preempted' or 'maintenance-event'")
        self.name = f"gcp:{key}"
        super().__init__(base_url, poll_interval_s, timeout_s)
        self.key = key
        self.path = PREEMPTED_PATH if key == "preempted" else MAINTENANCE_PATH
        self.long_poll = long_poll
        self._etag: str | None = None
        self._last_value: str | None = None
        self._repoll_now = False

    def instance_type(self) -> str | None:
        resp = self.request("GET", MACHINE_TYPE_PATH, headers=HEADERS)
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise self.fail(resp, f"GET {MACHINE_TYPE_PATH}")
        # "projects/<number>/machineTypes/<type>": the table is keyed by the type alone.
        return resp.text.strip().rsplit("/", 1)[-1] or None

    def next_delay(self, elapsed: float) -> float:
        # Chain long-polls back to back (they do the waiting), unless the server did not block.
        return 0.0 if self._repoll_now else self.poll_interval_s - elapsed

    def _check(self) -> list[Notice]:
        params: dict[str, str] = {}
        timeout = self.timeout_s
        wait_s = 0
        self._repoll_now = False
        if self.long_poll and self._etag is not None:
            wait_s = max(1, math.ceil(self.poll_interval_s))  # the API takes whole seconds
            params = {"wait_for_change": "true", "last_etag": self._etag, "timeout_sec": str(wait_s)}
            timeout = wait_s + self.timeout_s
        t0 = time.monotonic()
        resp = self.request("GET", self.path, headers=HEADERS, params=params, timeout=timeout)
        if resp.status_code != 200:
            raise self.fail(resp, f"GET {self.path}")
        etag = resp.headers.get("ETag")
        if self.long_poll and etag:
            blocked = time.monotonic() - t0 >= 0.5 * wait_s
            self._repoll_now = not wait_s or etag != self._etag or blocked
        self._etag = etag or self._etag
        value = resp.text.strip().upper()
        now = time.time()
        if value != self._last_value:
            self.log.debug("metadata value", value=value)
        self._last_value = value
        if self.key == "preempted":
            if value == "TRUE":
                return [Notice(provider="gcp", kind="preempt", deadline=now + GCP_NOTICE_S,
                               key="gcp:preempted", raw=value, received_at=now)]
            return []
        # maintenance-event: NONE, MIGRATE_ON_HOST_MAINTENANCE, TERMINATE_ON_HOST_MAINTENANCE.
        if value in ("", "NONE"):
            return []
        # The etag makes each occurrence its own notice (MIGRATE, NONE, MIGRATE again = two).
        # A live migration only pauses the VM briefly: at risk, no drain. TERMINATE is a stop.
        return [Notice(provider="gcp", kind="maintenance", deadline=now + GCP_MAINTENANCE_NOTICE_S,
                       key=f"gcp:maintenance:{value}:{self._etag}", drain=value.startswith("TERMINATE"),
                       raw=value, received_at=now)]
