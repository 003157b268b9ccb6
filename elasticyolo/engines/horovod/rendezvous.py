"""The leader's Horovod rendezvous server: Horovod's own HTTP server and elastic handler, bound to
one address, and re-answering a worker whose rank assignment never reached it.

A worker learns its rank in a reset from its GET `rank_and_size/<host>:<local rank>`, answered once
every worker of the reset has registered (the registry's barrier). If that answer cannot be written
(the worker's request connection was closed meanwhile), the worker retries the GET (Horovod's
client retries three times, 0.5 s apart). Horovod would register the retry in the *next* reset and
block it there, while its peers, who got their answers, wait for it in the new world's Gloo
context setup until Gloo's timeout (seen: 30 s, `test_failure_detection.py`). Here the retry gets
the answer it missed, as long as the world it was assigned to is still the current one.
"""

from __future__ import annotations

import threading
from typing import Any

from horovod.runner.elastic.rendezvous import GET_RANK_AND_SIZE, create_rendezvous_handler
from horovod.runner.http.http_server import RendezvousHTTPServer, RendezvousServer
from horovod.runner.util.threads import in_thread

from elasticyolo.log import get_logger

log = get_logger("elasticyolo.driver")


class BoundRendezvousServer(RendezvousServer):
    """`RendezvousServer` listening on one address (Horovod's binds to all interfaces)."""

    def __init__(self, addr: str, verbose: int = 0) -> None:
        super().__init__(verbose)
        self.addr = addr

    def start(self, handler_cls: Any = None) -> int:  # type: ignore[override]
        self._httpd = RendezvousHTTPServer((self.addr, 0), handler_cls, self._verbose)
        self._listen_thread = in_thread(target=self._httpd.serve_forever)
        return int(self._httpd.server_address[1])


class Undelivered:
    """Rank assignments that could not be written to their worker: slot -> the reset (Horovod's
    rendezvous id) whose world they belong to."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[tuple[str, int], int] = {}

    def add(self, host: str, slot: int, rendezvous_id: int) -> None:
        with self._lock:
            self._slots[(host, slot)] = rendezvous_id

    def take(self, host: str, slot: int, current_id: int) -> bool:
        """Whether the slot's missed answer is still the current world's (then it is consumed)."""
        with self._lock:
            return self._slots.pop((host, slot), None) == current_id


def rendezvous_handler(driver: Any) -> type:
    """Horovod's elastic rendezvous handler for `driver`, re-answering a missed rank assignment."""
    base: Any = create_rendezvous_handler(driver)
    undelivered = Undelivered()

    class Handler(base):  # type: ignore[misc, valid-type]
        missed = undelivered

        def do_GET(self) -> None:
            try:
                super().do_GET()
            except OSError:  # the answer could not be written: the worker will ask again
                slot = _rank_request(self.path)
                if slot is not None:
                    rid = driver._worker_registry.last_rendezvous()
                    undelivered.add(*slot, rid)
                    log.warning("rank assignment not delivered; the worker's retry gets it", slot=f"{slot[0]}[{slot[1]}]",
                                reset=rid)
                raise

        def _get_rank_and_size(self, host: str, local_rank: int) -> bytes:
            if (undelivered.take(host, local_rank, driver._worker_registry.last_rendezvous())
                    and driver.has_rank_assignment(host, local_rank)):
                info = driver.get_slot_info(host, local_rank)
                log.info("rank assignment delivered again", slot=f"{host}[{local_rank}]", rank=info.rank, size=info.size)
                return info.to_response_string().encode("ascii")  # type: ignore[no-any-return]
            return super()._get_rank_and_size(host, local_rank)  # type: ignore[no-any-return]

    return Handler


def _rank_request(path: str) -> tuple[str, int] | None:
    parts = path.split("/")
    if len(parts) != 3 or parts[1] != GET_RANK_AND_SIZE or ":" not in parts[2]:
        return None
    host, _, local_rank = parts[2].rpartition(":")
    return (host, int(local_rank)) if local_rank.isdigit() else None
