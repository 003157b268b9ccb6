"""The Ray engine's lifelines (engines/ray/lifeline.py): a real process holds one to a server on
loopback; its death closes it, and a new actor in the same slot opens the slot's again."""

from __future__ import annotations

import subprocess
import sys
import threading

from elasticyolo.engines.ray import lifeline
from elasticyolo.local_cluster.wait import wait_for

HOLD = "import sys, time; from elasticyolo.engines.ray import lifeline; " \
       "s = lifeline.connect('127.0.0.1', int(sys.argv[1]), sys.argv[2], 0); print('up', flush=True); time.sleep(600)"


def _actor(port: int, node: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(port), node], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    return proc


def test_a_killed_actor_closes_its_slots_lifeline_and_a_new_one_opens_it() -> None:
    woken: list[str] = []
    event = threading.Event()
    server = lifeline.LifelineServer("127.0.0.1", on_close=lambda slot: (woken.append(slot), event.set()))
    procs = [_actor(server.port, "n1"), _actor(server.port, "n2")]
    a = procs[0]
    try:
        assert not server.closed("n1", 0) and not server.closed("n2", 0)
        a.kill()
        assert event.wait(10) and woken == ["n1.0"]
        assert server.closed("n1", 0) and not server.closed("n2", 0)
        again = _actor(server.port, "n1")  # the slot's next actor
        procs.append(again)
        wait_for(lambda: not server.closed("n1", 0), 10, "the slot's new lifeline")
        again.kill()
        wait_for(lambda: server.closed("n1", 0), 10, "the new actor's lifeline closed")
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
