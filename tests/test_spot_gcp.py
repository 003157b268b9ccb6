"""GCP preemption / maintenance notices (long-polls) against the local metadata server."""

from __future__ import annotations

import time
from typing import Iterator

import pytest
import requests

from elasticyolo.local_cluster.metadata_server import MetadataServer, loopback_only
from elasticyolo.spot import Notice, NoticeWatcher, make_watcher
from elasticyolo.spot.gcp import GcpSource

from spot_support import Collector, polls_pass


@pytest.fixture(autouse=True)
def _loopback() -> Iterator[None]:
    with loopback_only():
        yield


def test_preempt_arrives_at_once_through_long_poll(md: MetadataServer) -> None:
    # A 2 s interval, yet the long-poll returns the moment the value changes.
    w = make_watcher("gcp", md.url, poll_interval_s=2.0, timeout_s=0.5)
    got = Collector()
    w.start(got)
    try:
        polls_pass(w, 1)  # the first answer gave the etag: the next request is a long-poll
        assert got == []
        t0 = time.monotonic()
        md.announce("gcp", action="preempt")
        [n] = got.wait(1)
        assert got.times[0] - t0 < 1.0  # well under the 2 s interval
        assert (n.provider, n.kind, n.drain) == ("gcp", "preempt", True)
        assert abs(n.seconds_left() - 30) < 1
        waits = [e for e in md.request_log if "wait_for_change=true" in e["path"] and "last_etag=" in e["path"]]
        assert waits, "expected wait_for_change long-polls with last_etag"
        polls_pass(w, 1)
        assert len(got) == 1
    finally:
        w.stop(timeout=1)


def test_plain_polling_without_long_poll(md: MetadataServer) -> None:
    src = GcpSource("preempted", md.url, 0.1, 0.5, long_poll=False)
    assert src.poll_once() == [] and src.poll_once() == []
    md.announce("gcp")
    [n] = src.poll_once()
    assert n.kind == "preempt"
    assert src.poll_once() == []
    assert not [e for e in md.request_log if "wait_for_change" in e["path"]]


def test_maintenance_migrate_is_at_risk_terminate_drains(md: MetadataServer) -> None:
    src = GcpSource("maintenance-event", md.url, 1.0, 0.5)
    assert src.poll_once() == []
    md.announce("gcp", action="MIGRATE_ON_HOST_MAINTENANCE")
    [n] = src.poll_once()
    assert (n.kind, n.drain) == ("maintenance", False)
    md.clear("gcp")
    assert src.poll_once() == []
    md.announce("gcp", action="maintenance")
    [n] = src.poll_once()
    assert (n.kind, n.drain, n.raw) == ("maintenance", True, "TERMINATE_ON_HOST_MAINTENANCE")


def test_repeated_maintenance_events_are_separate_notices(md: MetadataServer) -> None:
    w = NoticeWatcher([GcpSource("maintenance-event", md.url, 1.0, 0.5)])
    assert w.poll_once() == []
    md.announce("gcp", action="MIGRATE_ON_HOST_MAINTENANCE")
    assert len(w.poll_once()) == 1
    md.clear("gcp")
    assert w.poll_once() == []
    md.announce("gcp", action="MIGRATE_ON_HOST_MAINTENANCE")
    assert len(w.poll_once()) == 1
    assert len(w.notices) == 2


def test_5xx_and_timeouts_are_retried(md: MetadataServer) -> None:
    w = make_watcher("gcp", md.url, poll_interval_s=0.2, timeout_s=0.3, max_backoff_s=0.2)
    got = Collector()
    md.fail_next(4, status=500, path_prefix="/computeMetadata/v1/instance/preempted")
    md.delay_next(2, seconds=1.0, path_prefix="/computeMetadata/v1/instance/preempted")
    md.announce("gcp")
    w.start(got)
    try:
        [n] = got.wait(1, timeout=8)
        assert n.kind == "preempt"
        assert sum(1 for e in md.request_log if e["status"] == 500) == 4
    finally:
        w.stop(timeout=1)


def test_server_requires_metadata_flavor(md: MetadataServer) -> None:
    r = requests.get(md.url + "/computeMetadata/v1/instance/preempted", timeout=2)
    assert r.status_code == 403
