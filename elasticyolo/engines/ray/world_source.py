"""A Ray training actor's `WorldSource` (`engines/torch/world_watch.py`): its member record goes to
the job's controller actor (an actor call, in the order written), and the worlds the controller
publishes come from the job's store (`store.py`): `world/<uuid>` for each world, `world/latest`
for the newest. A thread waits on the next world's key with a store connection of its own, so a
world is seen as soon as it is written. The reads of the newest world (`_read`, also the training
thread's, every `POLL_S` while it waits for a world) go over another: a `TCPStore` client serves
one request at a time, and a read queued behind the blocking wait would return only when that wait
ends (up to `WAIT_S`), however soon the world came. Gloo uses the process group's own.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from elasticyolo.engines.ray import store as job_store
from elasticyolo.engines.torch.world_plan import MemberRecord
from elasticyolo.engines.torch.world_watch import POLL_S, WorldFeed
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.ray.worker")

LATEST_KEY = "world/latest"
# A wait for the next world's key is renewed this often (c10d logs a warning at each renewal; a
# world written meanwhile ends the wait at once).
WAIT_S = 5.0


def world_key(uuid: int) -> str:
    return f"world/{uuid}"


class RayWorldSource(WorldFeed):
    def __init__(self, controller: Any, host: str, port: int, generation: int, node: str, slot: int,
                 incarnation: int) -> None:
        super().__init__(generation, node, slot, incarnation)
        self.controller = controller
        self.store = job_store.client(host, port)  # reads
        self.waiting_store = job_store.client(host, port)  # the watch thread's blocking waits
        self._stop = threading.Event()

    def _write(self, record: MemberRecord) -> None:
        self.record = record
        self.controller.record.remote(json.dumps(record.to_json()))

    def start(self) -> None:
        self._read()
        threading.Thread(target=self._pump, name="ray-world-watch", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _read(self) -> None:
        try:
            if self.store.check([LATEST_KEY]):
                latest = int(self.store.get(LATEST_KEY))
                if latest > self.latest_uuid():
                    self._offer(self.store.get(world_key(latest)))
        except (dist.DistError, ValueError) as exc:  # the controller is gone: the next try
            log.debug("world unreadable", error=str(exc))

    def _pump(self) -> None:
        while not self._stop.is_set():
            key = world_key(self.latest_uuid() + 1)
            try:
                self.waiting_store.wait([key], timedelta(seconds=WAIT_S))
                self._offer(self.store.get(key))
            except dist.DistStoreError:
                self._read()  # none within WAIT_S (or this worker started behind: take the newest)
            except dist.DistError as exc:
                log.debug("world watch failed", error=str(exc))
                self._stop.wait(POLL_S)
