"""make_watcher (flags, auto-detection) and the metadata server run as a separate process."""

from __future__ import annotations

import time
from typing import Iterator

import pytest

from elasticyolo.errors import UserError
from elasticyolo.spot import Notice, make_watcher, probe
from elasticyolo.local_cluster.metadata_server import MetadataServer, MetadataServerProcess, loopback_only
from elasticyolo.local_cluster.servers import free_port
from elasticyolo.local_cluster.wait import wait_for
from spot_support import polls_pass


@pytest.fixture(autouse=True)
def _loopback() -> Iterator[None]:
    with loopback_only():
        yield


def test_flag_validation() -> None:
    with pytest.raises(UserError):
        make_watcher("oracle")
    with pytest.raises(UserError):
        make_watcher("aws", "169.254.169.254")  # no scheme
    with pytest.raises(UserError):
        make_watcher("aws", "http://127.0.0.1:1", poll_interval_s=0)


def test_defaults_point_at_real_addresses_without_contacting_them() -> None:
    assert [s.base_url for s in make_watcher("aws").sources] == ["http://169.254.169.254"]  # type: ignore[attr-defined]
    assert {s.base_url for s in make_watcher("gcp").sources} == {"http://metadata.google.internal"}  # type: ignore[attr-defined]
    w = make_watcher("azure", notice_file="/tmp/x")
    assert [s.name for s in w.sources] == ["azure", "file"]
    assert make_watcher("none").sources == []


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_auto_detects_the_configured_url_only(provider: str) -> None:
    with MetadataServer(providers=(provider,)) as md:
        assert probe(md.url, 0.5) == provider
        w = make_watcher("auto", md.url, poll_interval_s=0.1, timeout_s=0.5)
        assert w.provider == provider
        assert all(e["path"].split("?")[0] in (
            "/latest/api/token", "/computeMetadata/v1/instance/preempted", "/metadata/instance",
        ) for e in md.request_log)


def test_auto_with_nothing_listening_is_none_and_fast() -> None:
    t0 = time.monotonic()
    w = make_watcher("auto", f"http://127.0.0.1:{free_port()}", notice_file="/tmp/never")
    assert time.monotonic() - t0 < 2
    assert w.provider == "none" and [s.name for s in w.sources] == ["file"]


def test_server_as_a_process_driven_over_control_endpoints() -> None:
    with MetadataServerProcess() as md:
        got: list[Notice] = []
        w = make_watcher("aws", md.url, poll_interval_s=0.1, timeout_s=0.5, max_backoff_s=0.1)
        w.start(got.append)
        try:
            md.fail_next(2, status=502)
            polls_pass(w, 2)  # through both failures
            assert got == []
            md.expire_tokens()
            md.announce("aws", action="terminate", in_s=90)
            wait_for(lambda: got, 5, "the terminate notice")
            assert len(got) == 1 and abs(got[0].seconds_left() - 90) < 2
            statuses = {e["status"] for e in md.request_log}
            assert {200, 401, 404, 502} <= statuses
            ev = md.announce("azure", in_s=30)
            assert ev["EventType"] == "Preempt"
        finally:
            w.stop()


@pytest.mark.parametrize("provider,itype", [("aws", "p3.2xlarge"), ("gcp", "n1-standard-8"),
                                            ("azure", "Standard_NC6s_v3")])
def test_instance_type_from_metadata(provider: str, itype: str) -> None:
    """What prices a node by the price table when no --instance-type is given; a transient
    metadata failure is retried, a source that cannot say gives None."""
    with MetadataServer() as srv:
        srv.fail_next(2, status=503)
        assert make_watcher(provider, srv.url).instance_type(within_s=5) == itype
    assert make_watcher("none").instance_type() is None
    with MetadataServer(providers=()) as mute:  # answers 404 to every API
        assert make_watcher(provider, mute.url).instance_type(within_s=2) is None
