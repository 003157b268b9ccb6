"""The leader's rendezvous server re-answers a rank assignment that never reached its worker
(engines/horovod/rendezvous.py): Horovod's real HTTP server and handler, a stand-in driver."""

from __future__ import annotations

import socket
import struct
import threading
import urllib.request

from horovod.runner.common.util.hosts import SlotInfo

from elasticyolo.engines.horovod.rendezvous import BoundRendezvousServer, rendezvous_handler
from elasticyolo.local_cluster.wait import wait_for


class Registry:
    def __init__(self) -> None:
        self.rid = 1

    def last_rendezvous(self) -> int:
        return self.rid


class Driver:
    """Answers once the reset completes (`release`), as Horovod's barrier does."""

    def __init__(self) -> None:
        self._worker_registry = Registry()
        self.release = threading.Event()
        self.registrations: list[tuple[str, int]] = []
        self.info = SlotInfo(hostname="c", rank=0, local_rank=0, cross_rank=0, size=2, local_size=1, cross_size=2)

    def record_ready(self, host: str, slot: int) -> int:
        self.registrations.append((host, slot))
        self.release.wait(10)
        self._worker_registry.rid = 2  # the reset's action activated the new world
        return 1

    def has_rank_assignment(self, host: str, slot: int) -> bool:
        return host == "c"

    def get_slot_info(self, host: str, slot: int) -> SlotInfo:
        return self.info


def test_a_rank_assignment_cut_on_its_way_is_answered_again_without_a_second_registration() -> None:
    driver = Driver()
    server = BoundRendezvousServer("127.0.0.1")
    handler = rendezvous_handler(driver)
    port = server.start(handler)
    try:
        # The worker's request is cut while it waits for the reset (RST: nothing can be written).
        cut = socket.create_connection(("127.0.0.1", port))
        cut.sendall(b"GET /rank_and_size/c:0 HTTP/1.1\r\nHost: x\r\n\r\n")
        wait_for(lambda: driver.registrations, 5, "the worker registered")
        cut.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        cut.close()
        driver.release.set()
        wait_for(lambda: handler.missed._slots, 5, "the answer found undeliverable")
        # Its retry: answered with the world it was assigned to, not registered in the next reset.
        url = f"http://127.0.0.1:{port}/rank_and_size/c:0"
        body = wait_for(lambda: urllib.request.urlopen(url, timeout=5).read(), 10, "the retry answered")
        assert body.decode() == driver.info.to_response_string()
        assert driver.registrations == [("c", 0)]
    finally:
        server.stop()
