"""AWS IMDSv2 notices against the real local metadata server on 127.0.0.1."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from elasticyolo.spot import make_watcher
from elasticyolo.spot.aws import AwsSource
from elasticyolo.local_cluster.metadata_server import MetadataServer, loopback_only
from elasticyolo.local_cluster.servers import free_port
from elasticyolo.local_cluster.wait import wait_for
from spot_support import Collector, polls_pass

POLL = 0.1


@pytest.fixture(autouse=True)
def _loopback() -> Iterator[None]:
    with loopback_only():
        yield


def test_no_notice_then_one_terminate_within_a_poll(md: MetadataServer) -> None:
    w = make_watcher("aws", md.url, poll_interval_s=POLL, timeout_s=0.5)
    got = Collector()
    w.start(got)
    try:
        polls_pass(w)
        assert list(got) == []
        announced_at = time.monotonic()
        md.announce("aws", action="terminate", in_s=120)
        expected_deadline = time.time() + 120
        notices = got.wait(1)
        assert len(notices) == 1
        n = notices[0]
        assert (n.provider, n.kind, n.drain) == ("aws", "terminate", True)
        assert abs(n.deadline - expected_deadline) <= 1.5  # AWS times have 1 s resolution
        assert got.times[0] - announced_at < POLL + 1.0  # slack for a loaded 2-core box
        polls_pass(w)  # the server keeps announcing: still delivered once
        assert len(got) == 1
        assert w.notices == notices
    finally:
        w.stop()


@pytest.mark.parametrize("action", ["stop", "hibernate"])
def test_actions_map_to_kinds(md: MetadataServer, action: str) -> None:
    src = AwsSource(md.url, POLL, 0.5)
    assert src.poll_once() == []
    md.announce("aws", action=action, in_s=60)
    [n] = src.poll_once()
    assert n.kind == action and abs(n.seconds_left() - 60) <= 1.5
    assert src.poll_once() == []


def test_rebalance_is_at_risk_not_drain(md: MetadataServer) -> None:
    src = AwsSource(md.url, POLL, 0.5)
    md.announce("aws", action="rebalance")
    [n] = src.poll_once()
    assert (n.kind, n.drain) == ("rebalance", False)
    md.announce("aws", action="terminate", in_s=120)
    [n2] = src.poll_once()  # the real notice that follows is still delivered
    assert n2.kind == "terminate"
    drainer = AwsSource(md.url, POLL, 0.5, drain_on_rebalance=True)
    kinds = {n.kind: n.drain for n in drainer.poll_once()}
    assert kinds == {"rebalance": True, "terminate": True}


def test_token_renewed_before_expiry(md: MetadataServer) -> None:
    src = AwsSource(md.url, POLL, 0.5, token_ttl_s=1)
    found: list[list] = []

    def renewed() -> bool:  # polls until the 1 s token had to be renewed
        found.append(src.poll_once())
        return sum(1 for e in md.request_log if e["method"] == "PUT") >= 2

    wait_for(renewed, 5, "a second token")
    assert found and all(notices == [] for notices in found)
    log = md.request_log
    assert not [e for e in log if e["status"] == 401]


def test_expired_token_401_renewed_and_notice_delivered(md: MetadataServer) -> None:
    src = AwsSource(md.url, POLL, 0.5)
    assert src.poll_once() == []
    md.expire_tokens()
    md.announce("aws", in_s=120)
    [n] = src.poll_once()
    assert n.kind == "terminate"
    statuses = [(e["method"], e["status"]) for e in md.request_log]
    i = statuses.index(("GET", 401))
    assert ("PUT", 200) in statuses[i:]


def test_5xx_burst_is_retried_and_notice_delivered(md: MetadataServer) -> None:
    w = make_watcher("aws", md.url, poll_interval_s=POLL, timeout_s=0.5, max_backoff_s=0.2)
    got = Collector()
    md.fail_next(6, status=503)
    md.announce("aws", in_s=120)
    w.start(got)
    try:
        assert len(got.wait(1)) == 1
        assert sum(1 for e in md.request_log if e["status"] == 503) == 6
        assert w.status()["sources"]["aws"]["failures"] == 0
    finally:
        w.stop()


def test_timeouts_are_retried(md: MetadataServer) -> None:
    w = make_watcher("aws", md.url, poll_interval_s=POLL, timeout_s=0.3, max_backoff_s=0.2)
    got = Collector()
    md.delay_next(2, seconds=1.0)
    md.announce("aws", in_s=120)
    w.start(got)
    try:
        assert len(got.wait(1, timeout=6)) == 1
    finally:
        w.stop()


def test_connection_refused_until_server_appears() -> None:
    port = free_port()
    w = make_watcher("aws", f"http://127.0.0.1:{port}", poll_interval_s=POLL, timeout_s=0.3, max_backoff_s=0.2)
    got = Collector()
    w.start(got)
    try:
        wait_for(lambda: w.status()["sources"]["aws"]["failures"] >= 2, 5, "two failed polls")
        with MetadataServer(port=port) as md:
            md.announce("aws", in_s=120)
            assert len(got.wait(1)) == 1
    finally:
        w.stop()


def test_unparseable_time_defaults_to_two_minutes(md: MetadataServer) -> None:
    src = AwsSource(md.url, POLL, 0.5)
    md.state.aws_action = {"action": "terminate", "time": "soon"}
    [n] = src.poll_once()
    assert abs(n.seconds_left() - 120) < 1
