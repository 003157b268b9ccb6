"""Abort a worker's in-flight collective, so nobody waits out the backend's timeout on a lost peer.

Neither Horovod 0.28 nor torch's Gloo process group can abort a collective blocked on a peer that
stopped taking part (torch's `ProcessGroupGloo.abort()` returns, and the blocked all-reduce
stays blocked: measured with a SIGSTOPped peer). A rank blocked in a receive from such a peer
waits the backend's whole timeout. A `shutdown()` of the process's collective TCP connections
makes every peer blocked on it fail at once instead ("connection closed by peer"); each of them
does the same, so the whole world leaves the collective within milliseconds. Both engines use
it: a worker whose collective failed, and a worker told by its coordinator that a node of its
world was lost (a frozen node closes nothing).

Which sockets: the process's established TCP connections except those to etcd and those the
engine names (`kept`: Horovod's rendezvous server and notification service). Shutting down (not
closing) leaves the file descriptors to their owner (the backend closes them when it re-forms).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, Iterable

from elasticyolo.log import get_logger

log = get_logger("elasticyolo.worker")

# The ports an engine keeps open through an abort: (local ports, remote ports).
KeptPorts = Callable[[], tuple[set[int], set[int]]]
_OPEN = ("ESTABLISHED", "CLOSE_WAIT")  # psutil.CONN_* values


def _etcd_ports() -> set[int]:
    ports = set()
    for ep in (os.environ.get("ELASTICYOLO_ETCD") or "").split(","):
        tail = ep.strip().rsplit(":", 1)[-1].rstrip("/")
        if tail.isdigit():
            ports.add(int(tail))
    return ports


Conn = tuple[tuple[str, int], tuple[str, int]]  # (local, remote) address of a TCP connection


def nothing_kept() -> tuple[set[int], set[int]]:
    return set(), set()


def collective_connections(kept: KeptPorts = nothing_kept, states: Iterable[str] | None = _OPEN,
                           ) -> list[tuple[int, Conn]]:
    """This process's collective (Gloo) TCP connections in `states` (None: any), as
    (file descriptor, (local, remote) address)."""
    import psutil

    keep_local, keep_remote = kept()
    keep_remote = keep_remote | _etcd_ports()
    wanted = None if states is None else set(states)
    out = []
    for c in psutil.Process().net_connections(kind="tcp"):
        # CLOSE_WAIT too: the dead peer's own connections (its FIN arrived, Gloo has not acted on
        # it). Seen: a survivor that shut only its ESTABLISHED ones still waited out Gloo's timeout.
        if (wanted is not None and c.status not in wanted) or c.fd is None or c.fd < 0 or not c.raddr:
            continue
        if c.raddr.port in keep_remote or c.laddr.port in keep_local:
            continue
        out.append((c.fd, ((c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port))))
    return out


def abort_collectives(among: set[Conn] | None = None, kept: KeptPorts = nothing_kept) -> int:
    """Shut down this process's open collective connections (only those in `among` if given);
    returns how many."""
    n = 0
    for fd, conn in collective_connections(kept):
        if among is not None and conn not in among:
            continue
        try:
            dup = socket.fromfd(fd, socket.AF_INET, socket.SOCK_STREAM)  # a dup: gloo keeps its own fd
        except OSError:
            continue
        try:
            dup.shutdown(socket.SHUT_RDWR)
            n += 1
        except OSError:
            pass
        finally:
            dup.close()
    return n


class CollectiveAborter:
    """`abort()` shuts the collective connections now, then every `retry_s` shuts those of the
    connections that existed at the abort (in any state then) which are open again or still, until
    the worker has left the failed collective (`settled()`: its restore or reset began), at most
    `give_up_s`. Connections made after the abort (the next world's) are never touched.

    Once is not always enough (seen under load: a survivor shut 3 of its 4 Gloo connections and
    then waited out Gloo's 30 s timeout in its allreduce)."""

    def __init__(self, retry_s: float = 0.25, give_up_s: float = 10.0, kept: KeptPorts = nothing_kept) -> None:
        self.retry_s, self.give_up_s, self.kept = retry_s, give_up_s, kept
        self._settled = threading.Event()
        self._settled.set()
        self._lock = threading.Lock()
        self._doomed: set[Conn] = set()
        self._in_world = True  # False from a reset's start until the next world is up

    def abort(self) -> int | None:
        """Shut the collective connections (see the class); how many, or None: ignored while the
        worker is between worlds (`left`): the abort was meant for the world it left, and what it has open now is its
        rendezvous with the next one (seen: a late abort shut a rank's rendezvous request; the world
        formed without that rank and its peers sat out Gloo's 30 s timeout in their context setup)."""
        with self._lock:
            if not self._in_world:
                return None
            running = not self._settled.is_set()
            self._settled.clear()
            self._doomed |= {conn for _, conn in collective_connections(self.kept, states=None)}
            doomed = set(self._doomed)
        n = abort_collectives(among=doomed, kept=self.kept)
        if not running:
            threading.Thread(target=self._retry, name="abort-retry", daemon=True).start()
        return n

    def settled(self) -> None:
        """The worker left the collective: stop retrying."""
        with self._lock:
            self._settled.set()
            self._doomed = set()

    def left(self) -> None:
        """The worker left its world (its restore or reset began): stop retrying, and ignore
        aborts until `joined`."""
        with self._lock:
            self._in_world = False
        self.settled()

    def joined(self) -> None:
        """The worker is in a world again (its reset completed)."""
        with self._lock:
            self._in_world = True

    def _retry(self) -> None:
        deadline = time.monotonic() + self.give_up_s
        while not self._settled.wait(self.retry_s):
            with self._lock:
                doomed = set(self._doomed)
            if time.monotonic() > deadline:
                log.warning("collective still not failed after the abort", seconds=self.give_up_s,
                            left=[f"{conn}: {st}" for st, conn in _states(doomed)])
                self.settled()
                return
            n = abort_collectives(among=doomed, kept=self.kept)
            if n:
                log.info("collective aborted again", connections=n)


def _states(conns: set[Conn]) -> list[tuple[str, Conn]]:
    """The TCP state of each of `conns` now (for the log)."""
    import psutil

    out = []
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.raddr and ((c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port)) in conns:
            out.append((c.status, ((c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port))))
    return out
