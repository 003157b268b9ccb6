"""`elasticyolo report`: events from the agents' log as timeline marks, kills inferred from the
world size, and the PNG."""

from __future__ import annotations

from pathlib import Path

from elasticyolo.report import Timeline, cluster_events, inferred_kills, parse_series, render


def test_marks_kills_and_png(tmp_path: Path) -> None:
    raw = [{"at": 100.0, "kind": "state", "node": "a", "from": "IDLE", "to": "TRAINING"},
           {"at": 101.0, "kind": "leader", "node": "a", "term": 7},
           {"at": 150.0, "kind": "notice", "node": "b", "provider": "aws", "notice_kind": "terminate"},
           {"at": 151.0, "kind": "drain_start", "node": "b", "reason": "notice"},
           {"at": 160.0, "kind": "state", "node": "b", "from": "DRAINING", "to": "LEFT"},
           {"at": 170.0, "kind": "state", "node": "c", "from": "IDLE", "to": "JOINING"}]
    events = cluster_events(raw)
    assert [e["kind"] for e in events] == ["join", "leader", "notice", "drain", "leave"]
    series = parse_series([
        '{"t": 100, "world": 3, "samples_s": 30, "loss": 2.0}\n{"t": 155, "world": 2, "samples_s": 20, "loss": 1.5}\n',
        '{"t": 250, "world": 2, "samples_s": 20, "loss": 1.3}\n{"t": 300, "world": 1, "samples_s": 10, "loss": 1.2, '
        '"mAP50-95": 0.1}\ncut off li',
    ])
    assert [r["world"] for r in series] == [3, 2, 2, 1]
    kills = inferred_kills(series, events)  # 3 -> 2 follows b's notice; 2 -> 1 has no explanation
    assert [(k["t"], k["detail"]) for k in kills] == [(250, "world 2 -> 1")]
    out = render(Timeline(series, sorted(events + kills, key=lambda e: e["t"])), tmp_path / "t.png", title="j")
    from PIL import Image

    with Image.open(out) as im:
        im.load()
        assert im.size == (1200, 900)
