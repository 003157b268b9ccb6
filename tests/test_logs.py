"""Logs shipped to the job's store (`agent/log_shipping.py`) and read back by `elasticyolo logs`
(`commands/logs.py`), on a real file store. The end-to-end path through real agents is in
test_failures_where_user_looks.py."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from elasticyolo import log
from elasticyolo.agent.log_shipping import LogShipper, SegmentBuffer, parse_segment_key, segment_key
from elasticyolo.checkpoint.stores import open_store
from elasticyolo.commands.logs import LogReader, ordered, render


def record(event: str, ts: str, **fields: object) -> str:
    return json.dumps({"event": event, "level": "info", "timestamp": ts, **fields})


def test_segments_seal_at_their_size_and_only_changes_ship() -> None:
    buf = SegmentBuffer(segment_bytes=100, held=2)
    for i in range(3):
        buf.add(f"line {i:02d} " + "x" * 20)  # 29 bytes with the newline
    (only,) = buf.unshipped()
    seg, version, data = only
    assert seg.seq == 0 and version == 3 and data.count(b"\n") == 3
    buf.shipped(seg, version)
    assert buf.unshipped() == []
    buf.add("y" * 40)  # does not fit: segment 0 is sealed (shipped already), 1 begins
    assert [(s.seq, v) for s, v, _ in buf.unshipped()] == [(1, 1)]
    for _ in range(12):  # no store: at most `held` sealed segments are kept, the oldest go
        buf.add("z" * 60)
    assert len(buf.sealed) == 2 and buf.dropped > 0
    assert segment_key("job", "n1", 1700000000000, 3) == "job/logs/n1/1700000000000-000003.log"
    assert parse_segment_key("job", "job/logs/n1/1700000000000-000003.log") == ("n1", 1700000000000, 3)
    assert parse_segment_key("job", "job/run/results.csv") is None


def test_the_shipper_taps_the_log_and_the_reader_tails_and_follows(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}")
    out = io.StringIO()
    log.configure("info", stream=out)
    try:
        shipper = LogShipper("n1", "job", 1700000000.0, segment_bytes=400)
        log.get_logger("t").info("before the job named a store", n=1)
        assert shipper.flush() is False  # no store yet: held
        shipper._target = (f"file://{tmp_path}", {})
        log.forward_line('{"event": "from a child", "level": "warning", "timestamp": "2024-01-01T00:00:02Z"}')
        log.forward_line("plain output of a child")
        assert shipper.flush() is True
    finally:
        log.remove_tap(shipper.buffer.add)
        log.configure()
    assert "before the job named a store" in out.getvalue()  # the stream still gets everything
    reader = LogReader(store, "job")
    lines = [line for _seg, line in reader.tail(-1)]
    assert "before the job named a store" in lines[0] and lines[1:] == [
        '{"event": "from a child", "level": "warning", "timestamp": "2024-01-01T00:00:02Z"}',
        "plain output of a child"]
    assert [line for _s, line in LogReader(store, "job").tail(1)] == ["plain output of a child"]
    assert reader.new_lines() == []
    # A second node, and more lines of the first: only what is new comes, in time order.
    for i in range(20):
        shipper.buffer.add(record(f"step {i}", f"2024-01-01T00:00:{10 + i:02d}Z"))
    shipper.flush()
    store.put_bytes(segment_key("job", "n2", 1700000000500, 0),
                    (record("joined", "2024-01-01T00:00:15.5Z") + "\ntraceback line\n").encode())
    merged = ordered(reader.new_lines())
    assert [n for n, _ in merged].count("n1") == 20 and len(list(store.list("job/logs/n1/"))) > 1
    at = [line for _n, line in merged].index(record("joined", "2024-01-01T00:00:15.5Z"))
    assert merged[at - 1][1] == record("step 5", "2024-01-01T00:00:15Z") and merged[at + 1] == ("n2", "traceback line")
    assert [line for _s, line in LogReader(store, "job", node="n2").tail(5)] == [
        record("joined", "2024-01-01T00:00:15.5Z"), "traceback line"]


@pytest.mark.parametrize("line, shown", [
    (json.dumps({"event": "worker output", "level": "info", "timestamp": "2024-01-01T00:00:00Z", "slot": 0,
                 "line": "elasticyolo worker: error: x"}), 'worker output  slot=0  line="elasticyolo worker: error: x"'),
    ("Traceback (most recent call last):", "n1  Traceback (most recent call last):"),
])
def test_render(line: str, shown: str) -> None:
    assert render("n1", line).endswith(shown)
    assert render("n1", line, raw=True) == f"n1  {line}"
