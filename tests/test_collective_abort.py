"""The collective abort (worker_runtime/collective_abort.py) on real loopback TCP connections: it shuts the
connections that existed at the abort, keeps shutting them until the worker settles, and never
touches a connection made after the abort (the next world's).

The abort shuts every open TCP connection of its process, so each scenario runs in a fresh
interpreter of its own (a forked child would share, and shut, the test process's sockets)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PRELUDE = textwrap.dedent("""
    import socket, time
    from elasticyolo.worker_runtime.collective_abort import CollectiveAborter

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def connect():
        c = socket.create_connection(srv.getsockname())
        s, _ = srv.accept()
        return c, s

    def is_shut(sock, timeout=2.0):
        # A shut-down socket reads EOF at once; an open one times out.
        sock.settimeout(timeout)
        try:
            return sock.recv(1) == b""
        except (socket.timeout, TimeoutError):
            return False
        except OSError:
            return True
""")


def run_scenario(body: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_abort_shuts_old_connections_and_spares_new_ones() -> None:
    run_scenario("""
        old_c, old_s = connect()
        aborter = CollectiveAborter(retry_s=0.05, give_up_s=5.0)
        assert aborter.abort() >= 2  # both ends live in this process
        assert is_shut(old_c) and is_shut(old_s)
        new_c, new_s = connect()  # made while the retries run: the next world's
        time.sleep(0.3)  # several retry rounds (the point is that they did nothing)
        assert not is_shut(new_c, timeout=0.2)
        new_s.sendall(b"x")
        new_c.settimeout(2)
        assert new_c.recv(1) == b"x"
        aborter.settled()
    """)


def test_settled_stops_the_retries() -> None:
    run_scenario("""
        c, s = connect()
        aborter = CollectiveAborter(retry_s=0.05, give_up_s=5.0)
        aborter.abort()
        aborter.settled()
        assert aborter._settled.is_set() and not aborter._doomed
    """)


def test_an_abort_between_worlds_is_ignored() -> None:
    # A late abort (meant for the world this rank left) must not cut its rendezvous with the next
    # one: the connection open now is that rendezvous request.
    run_scenario("""
        aborter = CollectiveAborter(retry_s=0.05, give_up_s=5.0)
        aborter.left()  # the rank's reset began
        c, s = connect()
        assert aborter.abort() is None
        assert not is_shut(c, timeout=0.2) and aborter._settled.is_set()
        aborter.joined()  # in the next world: aborts act again
        n = aborter.abort()
        assert n is not None and n >= 2 and is_shut(c)
        aborter.settled()
    """)
