"""Fast failure signals between the agents and the leader, ahead of the etcd lease.

The lease stays the authority on membership and leadership; it is only slow (a TTL). Two faster
signals feed the leader's driver:

* **process death**: every agent keeps one TCP connection to the leader's agent. When an agent
  dies (SIGKILL, crash, reboot) the kernel closes its socket, so the leader sees EOF/RST at once:
  that node is DEAD (its workers died with it: worker_runtime/lifeline.py). A deliberate close says
  `bye` first (the agent moves to a new leader or stops) and is no verdict at all.
* **node vanished** (no FIN/RST: power loss, network cut, a frozen VM or agent): the agent sends a
  heartbeat every `interval_s`; none for `timeout_s` makes the node SUSPECT. A suspect is only
  taken out of discovery; its worker is counted failed only when the world resets without it
  (engines/horovod/driver.py), so an agent that is frozen while its worker trains never costs the
  world a healthy member, and a wrongly suspected node comes back with its next heartbeat.

Wire format: newline-terminated lines. Client -> server: `{"hello": node, "lease": id, "token": t}`,
then `.` per heartbeat, `bye` before a deliberate close. The server never writes. The token is a
random value the agent also puts in its node record (`liveness_token`): a verdict counts only when
the connection's token matches the node's record, so a process that can reach the port but not
etcd cannot make the leader drop a node by claiming its name.

Decisions are pure (`PeerTable` + `verdict`), stepped with a fake clock in tests/test_liveness.py;
`LivenessServer` (one selector thread) and `LivenessClient` (one thread) only apply them.
"""

from __future__ import annotations

import enum
import json
import selectors
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable

from elasticyolo.log import get_logger

log = get_logger("elasticyolo.liveness")

HELLO_TIMEOUT_S = 2.0  # a connection that does not say who it is within this is dropped


class Verdict(str, enum.Enum):
    UNKNOWN = "unknown"  # never connected (older agent, or not yet): the lease decides
    ALIVE = "alive"
    SUSPECT = "suspect"  # connected, but no heartbeat within the timeout
    DEAD = "dead"  # connection closed without `bye`: the agent process is gone


@dataclass
class Peer:
    node: str
    session: int  # which connection speaks for the node (the newest hello wins)
    last_beat: float
    closed_at: float | None = None  # EOF/RST without bye
    token: str = ""  # what the connection said in its hello (checked against the node record)


def verdict(peer: Peer | None, now: float, timeout_s: float) -> Verdict:
    if peer is None:
        return Verdict.UNKNOWN
    if peer.closed_at is not None:
        return Verdict.DEAD
    return Verdict.ALIVE if now - peer.last_beat < timeout_s else Verdict.SUSPECT


class PeerTable:
    """What the leader knows about each agent's connection (pure: the caller passes the clock)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.peers: dict[str, Peer] = {}
        self._by_session: dict[int, str] = {}

    def hello(self, session: int, node: str, now: float, token: str = "") -> None:
        self.peers[node] = Peer(node, session, now, token=token)
        self._by_session[session] = node

    def beat(self, session: int, now: float) -> None:
        peer = self._peer(session)
        if peer is not None:
            peer.last_beat = now

    def closed(self, session: int, now: float, graceful: bool) -> None:
        node = self._by_session.pop(session, None)
        peer = self.peers.get(node) if node else None
        if peer is None or peer.session != session:
            return  # an older connection of a node that has reconnected since
        if graceful:
            del self.peers[node]  # type: ignore[arg-type]
        else:
            peer.closed_at = now

    def forget(self, node: str) -> None:
        """The node is out of the cluster for good (its lease is gone): no verdict any more."""
        peer = self.peers.pop(node, None)
        if peer is not None:
            self._by_session.pop(peer.session, None)

    def verdicts(self, now: float) -> dict[str, Verdict]:
        return {n: verdict(p, now, self.timeout_s) for n, p in self.peers.items()}

    def _peer(self, session: int) -> Peer | None:
        node = self._by_session.get(session)
        peer = self.peers.get(node) if node else None
        return peer if peer is not None and peer.session == session else None


def changed(before: dict[str, Verdict], after: dict[str, Verdict]) -> dict[str, Verdict]:
    """Verdicts that differ (a node missing from `after` reads as UNKNOWN)."""
    out = {n: v for n, v in after.items() if before.get(n, Verdict.UNKNOWN) is not v}
    out.update({n: Verdict.UNKNOWN for n in before if n not in after and before[n] is not Verdict.UNKNOWN})
    return out


class LivenessServer:
    """Accepts the agents' connections (every agent listens; only the leader's gets them) and
    keeps a `PeerTable`. Listeners are called (from the server thread) on every verdict change."""

    def __init__(self, addr: str, timeout_s: float, port: int = 0, clock: Callable[[], float] = time.monotonic,
                 tick_s: float = 0.05) -> None:
        self.addr, self.clock, self.tick_s = addr, clock, tick_s
        self.table = PeerTable(timeout_s)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[dict[str, Verdict]], None]] = []
        self._sock = socket.create_server((addr, port), reuse_port=False)
        self._sock.setblocking(False)
        self.port = int(self._sock.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._sock, selectors.EVENT_READ, None)
        self._conns: dict[int, tuple[socket.socket, bytearray, float]] = {}  # session -> (sock, buffer, opened)
        self._seq = 0
        self._last: dict[str, Verdict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="liveness-server", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    def start(self) -> "LivenessServer":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        for sock, _, _ in list(self._conns.values()):
            sock.close()
        self._sock.close()
        self._sel.close()

    def add_listener(self, fn: Callable[[dict[str, Verdict]], None]) -> None:
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[dict[str, Verdict]], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def verdict(self, node: str, token: str | None = None) -> Verdict:
        """The node's verdict; UNKNOWN when `token` is given and the connection's differs."""
        with self._lock:
            peer = self.table.peers.get(node)
            if peer is not None and token is not None and peer.token != token:
                return Verdict.UNKNOWN
            return verdict(peer, self.clock(), self.table.timeout_s)

    def token_of(self, node: str) -> str | None:
        """The token the node's current connection presented in its hello."""
        with self._lock:
            peer = self.table.peers.get(node)
            return peer.token if peer is not None else None

    def lost(self, tokens: dict[str, str] | None = None) -> set[str]:
        """Nodes that must not be offered to the world now (DEAD or SUSPECT); with `tokens`
        (node -> its record's liveness token) only nodes whose connection presented that token."""
        with self._lock:
            now = self.clock()
            return {n for n, p in self.table.peers.items()
                    if verdict(p, now, self.table.timeout_s) in (Verdict.DEAD, Verdict.SUSPECT)
                    and (tokens is None or tokens.get(n) == p.token)}

    def forget(self, node: str) -> None:
        with self._lock:
            self.table.forget(node)

    # ---- the selector loop (executor) ---------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                events = self._sel.select(self.tick_s)
            except OSError:
                break
            now = self.clock()
            for key, _ in events:
                if key.data is None:
                    self._accept(now)
                else:
                    self._read(int(key.data), now)
            self._expire_unnamed(now)
            self._publish(now)

    def _accept(self, now: float) -> None:
        try:
            conn, _ = self._sock.accept()
        except OSError:
            return
        conn.setblocking(False)
        self._seq += 1
        self._conns[self._seq] = (conn, bytearray(), now)
        self._sel.register(conn, selectors.EVENT_READ, self._seq)

    def _read(self, session: int, now: float) -> None:
        if session not in self._conns:
            return
        sock, buf, _ = self._conns[session]
        try:
            data = sock.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(session, now, graceful=False)
            return
        buf.extend(data)
        while b"\n" in buf:
            line, _, rest = bytes(buf).partition(b"\n")
            buf[:] = rest
            self._line(session, line.strip(), now)
            if session not in self._conns:
                return

    def _line(self, session: int, line: bytes, now: float) -> None:
        with self._lock:
            if line == b"." or not line:
                self.table.beat(session, now)
            elif line == b"bye":
                pass  # handled below, after the lock
            else:
                try:
                    hello = json.loads(line)
                    node, token = str(hello["hello"]), str(hello.get("token") or "")
                except (ValueError, KeyError, TypeError, AttributeError):
                    node, token = "", ""
                if node:
                    self.table.hello(session, node, now, token)
        if line == b"bye":
            self._close(session, now, graceful=True)

    def _close(self, session: int, now: float, graceful: bool) -> None:
        sock, _, _ = self._conns.pop(session)
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        with self._lock:
            node = self.table._by_session.get(session)
            self.table.closed(session, now, graceful)
        if node and not graceful:
            log.info("agent connection closed", node=node)

    def _expire_unnamed(self, now: float) -> None:
        for session, (_, _, opened) in list(self._conns.items()):
            if session not in self.table._by_session and now - opened > HELLO_TIMEOUT_S:
                self._close(session, now, graceful=True)

    def _publish(self, now: float) -> None:
        with self._lock:
            current = self.table.verdicts(now)
            diff = changed(self._last, current)
            self._last = current
            listeners = list(self._listeners)
        if not diff:
            return
        for node, v in diff.items():
            if v in (Verdict.DEAD, Verdict.SUSPECT):
                log.warning("node lost", node=node, verdict=v.value)
            else:
                log.info("node liveness", node=node, verdict=v.value)
        for fn in listeners:
            try:
                fn(diff)
            except Exception as exc:  # noqa: BLE001 - a listener must not stop liveness
                log.error("liveness listener failed", error=str(exc))


class LivenessClient:
    """One agent's connection to its leader: `follow(endpoint)` (from the agent loop) points it
    at the current leader's server (None: no leader, or we lead); a thread connects, says hello,
    and sends a heartbeat every `interval_s`."""

    def __init__(self, node_id: str, interval_s: float, lease: Callable[[], int], token: str = "") -> None:
        self.node_id, self.interval_s, self.lease, self.token = node_id, interval_s, lease, token
        self._target: str | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="liveness-client", daemon=True)
        self.connected_to: str | None = None

    def start(self) -> "LivenessClient":
        self._thread.start()
        return self

    def follow(self, endpoint: str | None) -> None:
        with self._cond:
            if endpoint != self._target:
                self._target = endpoint
                self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(2)

    def _run(self) -> None:
        sock: socket.socket | None = None
        current: str | None = None
        while True:
            with self._cond:
                if self._stop:
                    break
                target = self._target
            if sock is not None and target != current:
                _bye(sock)
                sock, current, self.connected_to = None, None, None
            if sock is None and target is not None:
                sock = self._connect(target)
                current = target if sock is not None else None
                self.connected_to = current
            if sock is not None:
                try:
                    sock.sendall(b".\n")
                except OSError:
                    # Our own decision to drop the connection: say so (best effort), or the leader
                    # reads a close without `bye` as this agent's death and revokes its lease.
                    _bye(sock)
                    sock, current, self.connected_to = None, None, None
            with self._cond:
                if not self._stop:
                    self._cond.wait(self.interval_s)
        if sock is not None:
            _bye(sock)

    def _connect(self, endpoint: str) -> socket.socket | None:
        host, _, port = endpoint.rpartition(":")
        try:
            sock = socket.create_connection((host, int(port)), timeout=max(self.interval_s, 0.2))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            hello = {"hello": self.node_id, "lease": self.lease(), "token": self.token}
            sock.sendall(json.dumps(hello).encode() + b"\n")
            sock.settimeout(max(self.interval_s, 0.2))
            log.info("liveness connected", leader=endpoint)
            return sock
        except (OSError, ValueError) as exc:
            log.debug("liveness connect failed", leader=endpoint, error=str(exc))
            return None


def _bye(sock: socket.socket) -> None:
    try:
        sock.sendall(b"bye\n")
    except OSError:
        pass
    sock.close()
