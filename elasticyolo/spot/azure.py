"""Azure Scheduled Events: Preempt (and other VM-ending events), with acknowledgement."""

from __future__ import annotations

import time
from typing import Any

from elasticyolo.spot.base import HttpSource, MetadataError
from elasticyolo.spot.notice import AZURE_NOTICE_S, Notice, parse_rfc1123

DEFAULT_URL = "http://169.254.169.254"
API_VERSION = "2020-07-01"
EVENTS_PATH = "/metadata/scheduledevents"
NAME_PATH = "/metadata/instance/compute/name"
VM_SIZE_PATH = "/metadata/instance/compute/vmSize"
HEADERS = {"Metadata": "true"}
# EventType -> (kind, drain). Freeze pauses the VM for seconds: at risk only.
_EVENT_KINDS: dict[str, tuple[str, bool]] = {
    "Preempt": ("preempt", True),
    "Terminate": ("terminate", True),
    "Reboot": ("maintenance", True),
    "Redeploy": ("maintenance", True),
    "Freeze": ("maintenance", False),
}


class AzureSource(HttpSource):
    name = "azure"

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        poll_interval_s: float = 2.0,
        timeout_s: float = 2.0,
        instance_name: str | None = None,
        first_call_timeout_s: float = 120.0,
    ) -> None:
        super().__init__(base_url, poll_interval_s, timeout_s)
        self.instance_name = instance_name
        # Azure turns Scheduled Events on at the first request, which may take up to 2 minutes.
        self.first_call_timeout_s = max(first_call_timeout_s, timeout_s)
        self._answered_once = False
        self._name_lookup_done = instance_name is not None

    def instance_type(self) -> str | None:
        resp = self.request("GET", VM_SIZE_PATH, headers=HEADERS, params={"api-version": "2021-02-01", "format": "text"})
        if 400 <= resp.status_code < 500:
            return None
        if resp.status_code != 200:
            raise self.fail(resp, f"GET {VM_SIZE_PATH}")
        return resp.text.strip() or None

    def _resolve_name(self) -> None:
        """Learn the name of the VM it runs on, so events for other VMs in the same set are ignored."""
        try:
            resp = self.request("GET", NAME_PATH, headers=HEADERS,
                                params={"api-version": "2021-02-01", "format": "text"})
        except MetadataError as exc:
            self.log.debug("vm name lookup failed, will retry", error=str(exc))
            return
        if resp.status_code == 200 and resp.text.strip():
            self.instance_name = resp.text.strip()
            self._name_lookup_done = True
        elif 400 <= resp.status_code < 500:
            self._name_lookup_done = True  # not available here: accept every event
            self.log.info("vm name unavailable, not filtering events by resource", status=resp.status_code)

    def _check(self) -> list[Notice]:
        if not self._name_lookup_done:
            self._resolve_name()
        timeout = self.timeout_s if self._answered_once else self.first_call_timeout_s
        resp = self.request("GET", EVENTS_PATH, headers=HEADERS, params={"api-version": API_VERSION}, timeout=timeout)
        if resp.status_code != 200:
            raise self.fail(resp, f"GET {EVENTS_PATH}")
        self._answered_once = True
        try:
            doc = resp.json()
        except ValueError as exc:
            raise MetadataError(f"scheduled events: bad JSON {resp.text[:200]!r}") from exc
        now = time.time()
        return [n for ev in doc.get("Events", []) if (n := self._notice(ev, now)) is not None]

    def _notice(self, ev: dict[str, Any], now: float) -> Notice | None:
        kind_drain = _EVENT_KINDS.get(str(ev.get("EventType", "")))
        if kind_drain is None or not ev.get("EventId"):
            return None
        resources = ev.get("Resources") or []
        if self.instance_name and resources and self.instance_name not in resources:
            return None
        kind, drain = kind_drain
        not_before = parse_rfc1123(str(ev.get("NotBefore", "")))
        if not_before is None:  # empty once the event has started
            not_before = now if ev.get("EventStatus") == "Started" else now + AZURE_NOTICE_S
        return Notice(provider="azure", kind=kind, deadline=not_before, key=f"azure:{ev['EventId']}",
                      drain=drain, raw=ev, received_at=now, event_id=str(ev["EventId"]))

    def acknowledge(self, notice: Notice) -> bool:
        """Approve the event (POST StartRequests) so Azure proceeds now instead of at NotBefore."""
        if notice.provider != "azure" or not notice.event_id:
            return True
        body = {"StartRequests": [{"EventId": notice.event_id}]}
        for attempt in range(3):
            try:
                resp = self.request("POST", EVENTS_PATH, headers=HEADERS, params={"api-version": API_VERSION}, json=body)
                if resp.status_code == 200:
                    self.log.info("scheduled event acknowledged", event_id=notice.event_id)
                    return True
                err = f"HTTP {resp.status_code} {resp.text[:200]!r}"
            except MetadataError as exc:
                err = str(exc)
            self.log.warning("acknowledge failed", event_id=notice.event_id, attempt=attempt + 1, error=err)
            time.sleep(0.2 * 2**attempt)
        return False
