"""The collective abort (engines/horovod/abort.py) on real loopback TCP connections: it shuts the
connections that existed at the abort, keeps shutting them until the worker settles, and never
touches a connection made after the abort (the next world's)."""

from __future__ import annotations

import socket
import time
from typing import Iterator

import pytest

from elasticyolo.engines.horovod.abort import CollectiveAborter


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    yield srv
    srv.close()


def connect(srv: socket.socket) -> tuple[socket.socket, socket.socket]:
    c = socket.create_connection(srv.getsockname())
    s, _ = srv.accept()
    return c, s


def is_shut(sock: socket.socket, timeout: float = 2.0) -> bool:
    """A shut-down socket reads EOF at once; an open one times out."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True


def test_abort_shuts_old_connections_and_spares_new_ones(listener: socket.socket) -> None:
    old_c, old_s = connect(listener)
    aborter = CollectiveAborter(retry_s=0.05, give_up_s=5.0)
    try:
        assert aborter.abort() >= 2  # both ends live in this process
        assert is_shut(old_c) and is_shut(old_s)
        new_c, new_s = connect(listener)  # made while the retries run: the next world's
        time.sleep(0.3)  # several retry rounds (the point is that they did nothing)
        assert not is_shut(new_c, timeout=0.2)
        new_s.sendall(b"x")
        new_c.settimeout(2)
        assert new_c.recv(1) == b"x"
    finally:
        aborter.settled()
        for s in (old_c, old_s):
            s.close()


def test_settled_stops_the_retries(listener: socket.socket) -> None:
    aborter = CollectiveAborter(retry_s=0.05, give_up_s=5.0)
    aborter.abort()
    aborter.settled()
    assert aborter._settled.is_set() and not aborter._doomed
