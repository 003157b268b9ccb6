"""The provider-neutral interruption notice that every watcher delivers to the agent."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from email.utils import parsedate_to_datetime
from typing import Any

# Kinds a Notice can have. "rebalance" (and a live-migrate "maintenance") are at-risk signals, not
# a drain, unless configured otherwise; every other kind means the node is going away.
KINDS = ("terminate", "stop", "hibernate", "preempt", "rebalance", "maintenance", "signal", "file")

# Notice windows the providers promise when they give no explicit time.
AWS_NOTICE_S = 120.0
GCP_NOTICE_S = 30.0
GCP_MAINTENANCE_NOTICE_S = 60.0
AZURE_NOTICE_S = 30.0


@dataclass(frozen=True)
class Notice:
    """One interruption notice.

    provider: "aws" | "gcp" | "azure" | "local".
    deadline: epoch seconds by which the node may be gone (for at-risk kinds: a lower bound).
    key: the identity by which each notice is delivered once (e.g. the Azure EventId).
    drain: whether the agent should drain on it (False for at-risk signals by default).
    event_id: provider id to acknowledge when drained (Azure), else None.
    """

    provider: str
    kind: str
    deadline: float
    key: str
    drain: bool = True
    raw: Any = None
    received_at: float = field(default_factory=time.time)
    event_id: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown notice kind {self.kind!r} (one of {', '.join(KINDS)})")

    def seconds_left(self, now: float | None = None) -> float:
        return max(0.0, self.deadline - (time.time() if now is None else now))

    def to_dict(self) -> dict[str, Any]:
        """Everything, raw payload included (for the event log)."""
        return asdict(self)

    def to_record(self) -> dict[str, Any]:
        """Compact form for the etcd node record's `notice` field ({"action", "time", "source"}
        as NodeRecord documents, plus the rest without the raw payload)."""
        return {
            "action": self.kind, "time": self.deadline, "source": self.provider, "kind": self.kind,
            "deadline": self.deadline, "drain": self.drain, "received_at": self.received_at,
            "key": self.key, "event_id": self.event_id,
        }


def parse_iso8601(value: str) -> float | None:
    """AWS times look like '2017-09-18T08:22:00Z'; return epoch seconds or None if unparseable."""
    try:
        dt = datetime.fromisoformat(value.strip().replace("Z", "+00:00"))
    except (ValueError, AttributeError):
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def parse_rfc1123(value: str) -> float | None:
    """Azure NotBefore looks like 'Mon, 19 Sep 2016 18:29:47 GMT'; epoch seconds or None."""
    if not value or not value.strip():
        return None
    try:
        dt = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def format_iso8601(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def format_rfc1123(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=timezone.utc).strftime("%a, %d %b %Y %H:%M:%S GMT")
