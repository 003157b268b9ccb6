"""Spot wiring in the agent config and the drain's status rendering (no processes)."""

from __future__ import annotations

import time

import pytest

from elasticyolo.agent.drain import SpotDrain
from elasticyolo.config import load_agent_config
from elasticyolo.errors import UserError
from elasticyolo.local_cluster.metadata_server import MetadataServer
from elasticyolo.status import render_table


def cfg(flags: dict, env: dict | None = None):  # type: ignore[no-untyped-def]
    return load_agent_config("/dev/null", {"etcd": "127.0.0.1:2379", **flags}, environ=env or {})


def test_spot_settings_from_flags_and_env() -> None:
    c = cfg({"spot_provider": "aws", "metadata_url": "http://127.0.0.1:9", "spot_poll_interval": 0.5,
             "drain_on_rebalance": True})
    assert (c.spot_provider, c.metadata_url, c.spot_poll_interval, c.drain_on_rebalance) == \
        ("aws", "http://127.0.0.1:9", 0.5, True)
    assert cfg({}, {"ELASTICYOLO_SPOT_PROVIDER": "GCP"}).spot_provider == "gcp"
    assert cfg({}).spot_provider == "none" and cfg({}).drain_margin_s == 5.0
    with pytest.raises(UserError, match="spot_provider"):
        cfg({"spot_provider": "oracle"})
    with pytest.raises(UserError, match="metadata-url"):
        SpotDrain.from_config(cfg({"spot_provider": "aws", "metadata_url": "ftp://x"}))


def test_watcher_built_for_the_local_metadata_server() -> None:
    with MetadataServer() as md:
        spot = SpotDrain.from_config(cfg({"spot_provider": "azure", "metadata_url": md.url}))
        assert [s.name for s in spot.watcher.sources] and spot.watcher.provider == "azure"
        md.announce("azure", in_s=30)
        notices = spot.watcher.poll_once()
        assert notices and notices[0].drain and notices[0].kind == "preempt"


def test_status_shows_notice_and_drain_events() -> None:
    now = time.time()
    view = {"job": "j", "state": "running", "world_size": 1, "epoch": 0, "step": 5, "samples_s": None,
            "leader": "a", "leader_term": 7, "last_checkpoint": None,
            "nodes": [{"id": "b", "state": "DRAINING", "slots": 1, "ranks": [], "leader": False, "lease_ttl_s": 2,
                       "age_s": 3, "price_per_hour": None, "preemptible": True,
                       "notice": {"action": "terminate", "source": "aws", "deadline": now + 100}}],
            "events": [{"at": now, "node": "b", "kind": "notice", "provider": "aws", "notice_kind": "terminate",
                        "drain": True, "seconds_left": 100},
                       {"at": now, "node": "b", "kind": "drain_end", "notice_to_drained_s": 1.3, "lost_steps": 0,
                        "mode": "leave", "committed_step": 5}]}
    out = render_table(view)
    assert "aws:terminate in 9" in out
    assert "aws terminate notice" in out and "drained: 1.3s after the notice, lost steps 0" in out
