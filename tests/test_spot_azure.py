"""Azure Scheduled Events notices and acknowledgement against the local metadata server."""

from __future__ import annotations

import time
from typing import Iterator

import pytest
import requests

from elasticyolo.local_cluster.metadata_server import MetadataServer, loopback_only
from elasticyolo.spot import Notice, make_watcher
from elasticyolo.spot.azure import AzureSource
from elasticyolo.spot.notice import parse_rfc1123

from spot_support import Collector, polls_pass

POLL = 0.1


@pytest.fixture(autouse=True)
def _loopback() -> Iterator[None]:
    with loopback_only():
        yield


def test_preempt_then_acknowledge(md: MetadataServer) -> None:
    w = make_watcher("azure", md.url, poll_interval_s=POLL, timeout_s=0.5)
    got = Collector()
    w.start(got)
    try:
        polls_pass(w)
        assert got == []
        t0 = time.monotonic()
        ev = md.announce("azure", action="Preempt", in_s=30)
        [n] = got.wait(1)
        assert got.times[0] - t0 < POLL + 1.0  # slack for a loaded 2-core box
        assert (n.provider, n.kind, n.drain, n.event_id) == ("azure", "preempt", True, ev["EventId"])
        assert n.deadline == parse_rfc1123(ev["NotBefore"])
        assert abs(n.seconds_left() - 30) <= 1.5
        assert w.acknowledge(n) is True
        assert md.acknowledged == [ev["EventId"]]
        post = [e for e in md.request_log if e["method"] == "POST"]
        assert post and post[0]["path"].startswith("/metadata/scheduledevents?api-version=2020-07-01")
        polls_pass(w)  # now "Started" with an empty NotBefore: same event, not a new notice
        assert len(got) == 1
    finally:
        w.stop()


def test_other_vm_events_ignored_and_freeze_is_at_risk(md: MetadataServer) -> None:
    src = AzureSource(md.url, POLL, 0.5, first_call_timeout_s=2)
    md.announce("azure", action="Preempt", resource="some-other-vm")
    assert src.poll_once() == []
    assert src.instance_name == "elasticyolo-test-vm"  # learned from IMDS
    md.announce("azure", action="Freeze")
    [n] = src.poll_once()
    assert (n.kind, n.drain) == ("maintenance", False)


def test_5xx_and_timeouts_are_retried(md: MetadataServer) -> None:
    w = make_watcher("azure", md.url, poll_interval_s=POLL, timeout_s=0.3, max_backoff_s=0.2,
                     azure_first_call_timeout_s=0.3)
    got = Collector()
    md.fail_next(5, status=503, path_prefix="/metadata/scheduledevents")
    md.delay_next(2, seconds=1.0, path_prefix="/metadata/scheduledevents")
    md.announce("azure", in_s=30)
    w.start(got)
    try:
        [n] = got.wait(1, timeout=8)
        assert n.kind == "preempt"
    finally:
        w.stop()


def test_acknowledge_retries_through_a_5xx(md: MetadataServer) -> None:
    src = AzureSource(md.url, POLL, 0.5, first_call_timeout_s=2)
    ev = md.announce("azure")
    [n] = src.poll_once()
    md.fail_next(1, status=500)
    assert src.acknowledge(n) is True
    assert md.acknowledged == [ev["EventId"]]


def test_server_requires_metadata_header(md: MetadataServer) -> None:
    r = requests.get(md.url + "/metadata/scheduledevents?api-version=2020-07-01", timeout=2)
    assert r.status_code == 400
