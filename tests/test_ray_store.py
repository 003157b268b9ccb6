"""The Ray engine's worker-side pieces on a real `TCPStore` (no Ray cluster): the process-group
store's abortable waits, and a training actor's world source reading the worlds the controller
writes and sending its member record."""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

import pytest

pytest.importorskip("torch")

from elasticyolo.engines.ray import store as job_store  # noqa: E402
from elasticyolo.engines.ray.store import AbortableStore  # noqa: E402
from elasticyolo.engines.ray.world_source import LATEST_KEY, RayWorldSource, world_key  # noqa: E402
from elasticyolo.engines.torch.world_plan import MemberRecord, World  # noqa: E402


@pytest.fixture
def server() -> Any:
    return job_store.serve("127.0.0.1")


def test_a_wait_ends_when_the_key_is_written_or_when_the_abort_check_gives_a_reason(server: Any) -> None:
    store = AbortableStore("127.0.0.1", server.port, timedelta(seconds=30))
    assert store.add("incarnation", 1) == 1 and store.add("incarnation", 1) == 2
    server.set("a", b"1")
    assert store.get("a") == b"1"
    store.abort_check = lambda key: "a newer world is out" if key == "never" else None
    t0 = time.monotonic()
    with pytest.raises(LookupError, match="a newer world is out"):
        store.get("never")
    assert time.monotonic() - t0 < 5  # not the store's 30 s timeout


class FakeController:
    """The controller's `record` actor method, as a training actor calls it (`.remote`)."""

    def __init__(self) -> None:
        self.records: list[MemberRecord] = []
        outer = self

        class Method:
            def remote(self, raw: str) -> None:
                outer.records.append(MemberRecord.from_json(json.loads(raw)))

        self.record = Method()


def publish(server: Any, world: World, generation: int) -> None:
    server.set(world_key(world.uuid), json.dumps({**world.to_json(), "generation": generation}))
    server.set(LATEST_KEY, str(world.uuid))


def test_the_world_source_follows_the_controllers_worlds_and_sends_its_record(server: Any) -> None:
    controller = FakeController()
    publish(server, World(1, ("n1.0.1",), ("h1",), ("n1",)), generation=7)  # written before it starts
    source = RayWorldSource(controller, "127.0.0.1", server.port, 7, "n2", 0, 2)
    seen: list[int] = []
    source.on_world = lambda w: seen.append(w.uuid)
    source.start()
    try:
        assert source.latest_uuid() == 1
        source.register("handle-a")
        source.entered(1, False, "handle-b")
        assert [(r.member, r.handle, r.tried) for r in controller.records] == [
            ("n2.0.2", "handle-a", 0), ("n2.0.2", "handle-b", 1)]
        publish(server, World(2, ("n1.0.1", "n2.0.2"), ("h1", "handle-b"), ("n1", "n2")), generation=7)
        got = source.wait(lambda w: w is not None and source.member in w.members, timeout_s=10)
        assert got is not None and got.uuid == 2 and seen == [1, 2]
        source.leave()
        assert controller.records[-1].leaving
    finally:
        source.stop()


def test_reading_the_newest_world_does_not_wait_behind_the_watch_threads_wait(server: Any) -> None:
    """The training thread re-reads the newest world every POLL_S while it waits for one; the watch
    thread meanwhile blocks in a wait for the next world's key (WAIT_S). The read must not queue
    behind that wait: a TCPStore client serves one request at a time."""
    source = RayWorldSource(FakeController(), "127.0.0.1", server.port, 7, "n2", 0, 2)
    source.start()
    try:
        time.sleep(0.3)  # the watch thread is in its wait for world 1
        t0 = time.monotonic()
        source._read()
        assert time.monotonic() - t0 < 1.0  # not the wait's WAIT_S (5 s)
    finally:
        source.stop()
