"""Local notice sources (file, signal) and the watcher's delivery guarantees."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from elasticyolo.spot import Notice, NoticeWatcher, make_watcher
from elasticyolo.spot.base import MetadataError, NoticeSource
from elasticyolo.spot.local import FileSource, signal_notice
from spot_support import Collector, polls_pass


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_file_source_deadline_and_once(tmp_path: Path) -> None:
    path = tmp_path / "notice"
    src = FileSource(path, 0.05)
    assert src.poll_once() == []
    deadline = time.time() + 45
    write_atomic(path, json.dumps({"deadline": deadline, "reason": "operator"}))
    [n] = src.poll_once()
    assert (n.provider, n.kind, n.drain, n.deadline) == ("local", "file", True, deadline)
    assert src.poll_once() == []
    path.unlink()
    assert src.poll_once() == []
    write_atomic(path, json.dumps({"in_s": 10}))  # a new file is a new notice
    [n2] = src.poll_once()
    assert abs(n2.seconds_left() - 10) < 1


def test_empty_file_uses_default_deadline(tmp_path: Path) -> None:
    path = tmp_path / "notice"
    path.touch()
    [n] = FileSource(path, 0.05, default_notice_s=30).poll_once()
    assert abs(n.seconds_left() - 30) < 1


def test_file_watcher_threaded(tmp_path: Path) -> None:
    path = tmp_path / "notice"
    got = Collector()
    w = make_watcher("none", notice_file=str(path), poll_interval_s=0.05)
    w.start(got)
    try:
        polls_pass(w)
        assert got == []
        write_atomic(path, "")
        assert len(got.wait(1)) == 1
        polls_pass(w)
        assert len(got) == 1
    finally:
        w.stop()


def test_sigterm_becomes_one_notice() -> None:
    got = Collector()
    w = make_watcher("none", signal_deadline_s=20)
    previous = w.install_signal_handlers([signal.SIGTERM])
    try:
        w.start(got)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        w.inject(signal_notice(signal.SIGUSR1))  # delivered in order: once it is in, both SIGTERMs were handled
        n, last = got.wait(2)
        assert len(got) == 2 and last.raw == {"signal": "SIGUSR1"}
        assert (n.kind, n.raw, n.drain) == ("signal", {"signal": "SIGTERM"}, True)
        assert abs(n.seconds_left() - 20) < 1
    finally:
        signal.signal(signal.SIGTERM, previous[signal.SIGTERM])
        w.stop()


def test_inject_before_start_and_poll_once() -> None:
    w = NoticeWatcher()
    w.inject_signal(signal.SIGINT, deadline_in_s=5)
    [n] = w.poll_once()
    assert n.key == "signal:SIGINT"
    w.inject_signal(signal.SIGINT)
    assert w.poll_once() == []


class Flaky(NoticeSource):
    """Fails, then announces, then a bad callback must not stop the next notice."""

    name = "flaky"

    def __init__(self) -> None:
        super().__init__(0.02)
        self.calls = 0

    def _check(self) -> list[Notice]:
        self.calls += 1
        if self.calls <= 3:
            raise MetadataError("boom")
        if self.calls == 4:
            raise RuntimeError("unexpected bug")  # still never fatal
        out = [Notice("local", "file", time.time() + 5, key="a")]
        if self.calls >= 8:
            out.append(Notice("local", "file", time.time() + 5, key="b"))
        return out


def test_errors_and_bad_callbacks_are_not_fatal() -> None:
    got = Collector()

    def cb(n: Notice) -> None:
        got(n)
        if n.key == "a":
            raise ValueError("callback bug")

    w = NoticeWatcher([Flaky()], max_backoff_s=0.05)
    w.start(cb)
    threads = list(w._threads)
    try:
        assert [n.key for n in got.wait(2)] == ["a", "b"]
        assert w.status()["sources"]["flaky"]["failures"] == 0
    finally:
        w.stop()
    assert not any(t.is_alive() for t in threads)


def test_notice_validation_and_dict() -> None:
    with pytest.raises(ValueError):
        Notice("aws", "explode", 0.0, key="x")
    d = Notice("aws", "terminate", 1.0, key="k").to_dict()
    assert d["kind"] == "terminate" and d["deadline"] == 1.0 and d["event_id"] is None
    r = Notice("azure", "preempt", 2.0, key="azure:E", event_id="E", raw={"big": 1}).to_record()
    assert (r["action"], r["time"], r["source"], r["event_id"]) == ("preempt", 2.0, "azure", "E")
    assert "raw" not in r
