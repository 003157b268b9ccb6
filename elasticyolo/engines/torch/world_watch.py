"""A torch engine worker's view of its worlds (worker side): its member record, and the newest
world the coordinator published (`coordinator.py`, `world_plan.py`). `WorldSource` is what the
worker (`worker.py`) needs; `WorldFeed` is its cluster-neutral part (the member record's fields,
the newest world, the waits), and `WorldWatch` implements it on etcd (the Ray engine's
`engines/ray/world_source.py` on its controller).

* `register`/`entered`/`leave` write this worker's `MemberRecord`: its reconfiguration handle
  (which changes with every world it enters), the last world it tried and whether it got in,
  and whether it asked to leave (a drain or a stop).
* A watch on the `world` key keeps `latest` current; `on_world` is called with every newer world
  (the worker aborts a collective blocked on a lost peer from there). `wait` blocks until a world
  satisfies a condition, re-reading the key every `POLL_S` in case the watch missed an event.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Protocol

from elasticyolo.engines.torch.world_plan import MemberRecord, World
from elasticyolo.log import get_logger

if TYPE_CHECKING:
    from elasticyolo.cluster.etcd import EtcdClient
    from elasticyolo.cluster.keys import JobKeys

log = get_logger("elasticyolo.torch.worker")

POLL_S = 0.5


class WorldSource(Protocol):
    """A worker's member record and its worlds, on whatever the cluster keeps them in."""

    on_world: Callable[[World], None] | None  # called with every newer world (from any thread)

    @property
    def member(self) -> str: ...
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def register(self, handle: str) -> None: ...
    def entered(self, uuid: int, ok: bool, handle: str) -> None: ...
    def failed(self, uuid: int) -> None: ...
    def leave(self) -> None: ...
    def latest_uuid(self) -> int: ...
    def wait(self, ready: Callable[[World | None], bool], timeout_s: float | None = None) -> World | None: ...
    def poke(self) -> None: ...


class WorldFeed:
    """The cluster-neutral part of a `WorldSource`: this worker's member record (written through
    `_write`) and the newest world offered to `_offer` (by a watch or `_read`, the subclass's)."""

    def __init__(self, generation: int, node: str, slot: int, incarnation: int) -> None:
        self.generation = generation
        self.record = MemberRecord(member=f"{node}.{slot}.{incarnation}", node=node, handle="")
        self.latest: World | None = None
        self.on_world: Callable[[World], None] | None = None
        self._cond = threading.Condition()

    @property
    def member(self) -> str:
        return self.record.member

    def _write(self, record: MemberRecord) -> None:
        raise NotImplementedError

    def _read(self) -> None:
        """Offer the stored world again (a missed watch event); nothing by default."""

    # ---- the member record ---------------------------------------------------------------------
    def register(self, handle: str) -> None:
        self._write(replace(self.record, handle=handle))

    def entered(self, uuid: int, ok: bool, handle: str) -> None:
        self._write(replace(self.record, handle=handle, tried=uuid, entered=ok))

    def failed(self, uuid: int) -> None:
        """The collective of world `uuid` failed here: this worker is alive, a peer may not be."""
        try:
            self._write(replace(self.record, failed=uuid))
        except Exception as exc:  # noqa: BLE001 - the coordinator then decides without it
            log.debug("member record not marked failed", error=str(exc))

    def leave(self) -> None:
        """Ask to be left out of the next world (best effort: the launcher deletes the record when
        this process exits anyway)."""
        try:
            self._write(replace(self.record, leaving=True))
        except Exception as exc:  # noqa: BLE001
            log.debug("member record not marked leaving", error=str(exc))

    # ---- the worlds ----------------------------------------------------------------------------
    def _offer(self, raw: bytes) -> None:
        try:
            data = json.loads(raw)
        except ValueError:
            return
        if not isinstance(data, dict) or data.get("generation") != self.generation:
            return
        world = World.from_json(data)
        if world is None:
            return
        with self._cond:
            if self.latest is not None and world.uuid <= self.latest.uuid:
                return
            self.latest = world
            self._cond.notify_all()
        if self.on_world is not None:
            self.on_world(world)

    def latest_uuid(self) -> int:
        w = self.latest
        return w.uuid if w is not None else 0

    def wait(self, ready: Callable[[World | None], bool], timeout_s: float | None = None) -> World | None:
        """Block until `ready(latest)` holds (or `timeout_s` passes); returns the latest world."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            with self._cond:
                if ready(self.latest):
                    return self.latest
                left = POLL_S if deadline is None else min(POLL_S, deadline - time.monotonic())
                if left <= 0:
                    return self.latest
                self._cond.wait(left)
            if not ready(self.latest):
                self._read()

    def poke(self) -> None:
        """Wake `wait` (its condition may have changed: a stop was asked for)."""
        with self._cond:
            self._cond.notify_all()


class WorldWatch(WorldFeed):
    def __init__(self, client: "EtcdClient", keys: "JobKeys", generation: int, node: str, slot: int,
                 incarnation: int) -> None:
        super().__init__(generation, node, slot, incarnation)
        self.client, self.keys = client, keys
        self.key = keys.torch_member(generation, node, slot)
        self._cancel: Callable[[], None] | None = None

    def _write(self, record: MemberRecord) -> None:
        self.record = record
        self.client.put(self.key, json.dumps(record.to_json()))

    def remove(self) -> None:
        try:
            self.client.delete(self.key)
        except Exception as exc:  # noqa: BLE001 - the launcher deletes it too
            log.debug("member record not deleted", error=str(exc))

    # ---- the worlds ----------------------------------------------------------------------------
    def start(self) -> None:
        self._read()
        events, self._cancel = self.client.watch_prefix(self.keys.world)

        def pump() -> None:
            try:
                for ev in events:
                    if ev.key == self.keys.world and ev.value:
                        self._offer(ev.value)
            except Exception as exc:  # noqa: BLE001 - `wait` polls too
                log.debug("world watch ended", error=str(exc))

        threading.Thread(target=pump, name="torch-world-watch", daemon=True).start()

    def stop(self) -> None:
        if self._cancel is not None:
            self._cancel()

    def _read(self) -> None:
        try:
            got = self.client.get(self.keys.world)
        except Exception as exc:  # noqa: BLE001 - etcd hiccup: the next poll
            log.debug("world unreadable", error=str(exc))
            return
        if got is not None:
            self._offer(got[0])
