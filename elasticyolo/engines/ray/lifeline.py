"""Lifelines: one TCP connection from each training actor to its job's controller, held open for
the actor's life. When the actor's process ends, its kernel closes the connection, and the
controller reads the end of it at once (`LifelineServer.closed`).

Why beside Ray's own actor-death notification: Ray reports an actor dead at once when its raylet
sees the process exit, but when the whole node goes (the raylet with it) only after the GCS's
health checks of the node fail, seconds later; meanwhile a call to the actor waits. A world whose
collective failed is re-formed without the members whose lifelines closed, with no wait. A node
that vanishes without closing its connections (a frozen VM, a cut network) is still found by the
controller's ping and, later, by Ray's health checks (`controller.py`).
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from typing import Callable

from elasticyolo.log import get_logger

log = get_logger("elasticyolo.ray.lifeline")

HELLO_MAX = 256  # the first line an actor sends: its slot's name, `<node>.<slot>`


def slot_key(node: str, slot: int) -> str:
    return f"{node}.{slot}"


class LifelineServer:
    """The controller's end: accepts lifelines and keeps, per slot, when its newest one closed."""

    def __init__(self, host: str, on_close: Callable[[str], None]) -> None:
        self.sock = socket.create_server((host, 0))
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        self.on_close = on_close
        self._lock = threading.Lock()
        self._closed: dict[str, float] = {}
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.sock, selectors.EVENT_READ, None)
        self._names: dict[socket.socket, str] = {}
        self._latest: dict[str, socket.socket] = {}  # per slot, its newest actor's lifeline
        self._buffers: dict[socket.socket, bytes] = {}
        threading.Thread(target=self._serve, name="ray-lifelines", daemon=True).start()

    def closed(self, node: str, slot: int) -> bool:
        """Whether the newest lifeline of the slot's actor has closed (its process ended)."""
        with self._lock:
            return slot_key(node, slot) in self._closed

    def _serve(self) -> None:
        while True:
            for key, _ in self._sel.select():
                try:
                    if key.data is None:
                        self._accept()
                    else:
                        self._read(key.fileobj)  # type: ignore[arg-type]
                except OSError as exc:  # noqa: PERF203 - one bad connection must not stop the rest
                    log.debug("lifeline error", error=str(exc))

    def _accept(self) -> None:
        conn, _ = self.sock.accept()
        conn.setblocking(False)
        self._buffers[conn] = b""
        self._sel.register(conn, selectors.EVENT_READ, "conn")

    def _read(self, conn: socket.socket) -> None:
        try:
            data = conn.recv(HELLO_MAX)
        except BlockingIOError:
            return
        except ConnectionResetError:
            data = b""
        if not data:
            self._end(conn)
        elif conn in self._buffers:  # the hello line, maybe in pieces; nothing follows it
            self._buffers[conn] += data
            if b"\n" in self._buffers[conn]:
                name = self._buffers.pop(conn).split(b"\n", 1)[0].decode(errors="replace")
                self._names[conn] = name
                with self._lock:
                    self._latest[name] = conn
                    self._closed.pop(name, None)  # a new actor in the slot

    def _end(self, conn: socket.socket) -> None:
        self._sel.unregister(conn)
        conn.close()
        self._buffers.pop(conn, None)
        name = self._names.pop(conn, None)
        if name is None:
            return
        with self._lock:
            if self._latest.get(name) is not conn:
                return  # an older actor of the slot
            del self._latest[name]
            self._closed[name] = time.time()
        log.info("lifeline closed", slot=name)
        self.on_close(name)


def connect(host: str, port: int, node: str, slot: int) -> socket.socket:
    """The actor's end: open for as long as this process lives (keep a reference to it)."""
    sock = socket.create_connection((host, port), timeout=30)
    sock.sendall(f"{slot_key(node, slot)}\n".encode())
    return sock
