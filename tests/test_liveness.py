"""Fast failure signals: the pure verdicts and slot decisions stepped with a fake clock,
the liveness server/client over real loopback sockets (a SIGKILLed process is seen at once, a
SIGSTOPped one at the heartbeat timeout), and the one-line errors for bad timeout settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from elasticyolo.cluster.etcd import b64
from elasticyolo.cluster.liveness import LivenessClient, LivenessServer, PeerTable, Verdict, changed, verdict
from elasticyolo.engines.horovod.failures import SlotFacts, slot_outcome
from elasticyolo.local_cluster.agents import ELASTICYOLO
from elasticyolo.local_cluster.wait import wait_for

REPO = Path(__file__).resolve().parents[1]


# ---- pure: peer table ------------------------------------------------------------------------
def test_verdicts_follow_connection_and_heartbeats() -> None:
    t = PeerTable(timeout_s=1.0)
    assert verdict(None, 0.0, 1.0) is Verdict.UNKNOWN
    t.hello(1, "a", now=0.0)
    t.hello(2, "b", now=0.0)
    assert t.verdicts(0.5) == {"a": Verdict.ALIVE, "b": Verdict.ALIVE}
    t.beat(1, now=0.9)
    assert t.verdicts(1.2) == {"a": Verdict.ALIVE, "b": Verdict.SUSPECT}  # b: no beat for 1.2 s
    t.beat(2, now=1.3)  # a wrongly suspected node is back with its next beat
    assert t.verdicts(1.4)["b"] is Verdict.ALIVE
    t.closed(1, now=1.5, graceful=False)  # EOF/RST: the agent process is gone
    assert t.verdicts(1.5)["a"] is Verdict.DEAD
    t.closed(2, now=1.6, graceful=True)  # bye: no verdict at all
    assert "b" not in t.verdicts(1.6)


def test_reconnect_supersedes_the_old_connection() -> None:
    t = PeerTable(timeout_s=1.0)
    t.hello(1, "a", now=0.0)
    t.hello(2, "a", now=0.5)  # the agent restarted (or moved to this leader again)
    t.closed(1, now=0.6, graceful=False)  # the old connection's close says nothing now
    assert t.verdicts(0.7) == {"a": Verdict.ALIVE}
    t.beat(1, now=5.0)  # nor do its beats
    assert t.verdicts(5.0) == {"a": Verdict.SUSPECT}
    t.forget("a")
    assert t.verdicts(5.0) == {}


def test_changed_reports_differences_only() -> None:
    before = {"a": Verdict.ALIVE, "b": Verdict.ALIVE}
    after = {"a": Verdict.ALIVE, "b": Verdict.DEAD, "c": Verdict.ALIVE}
    assert changed(before, after) == {"b": Verdict.DEAD, "c": Verdict.ALIVE}
    assert changed(after, {}) == {"a": Verdict.UNKNOWN, "b": Verdict.UNKNOWN, "c": Verdict.UNKNOWN}


# ---- pure: when the driver counts a worker failed ---------------------------------------------
def facts(**kw: object) -> SlotFacts:
    base = dict(exit_code=None, stopping=False, liveness=Verdict.ALIVE, record_present=True, assigned=True,
                registered=False, reset_pending_s=None)
    return SlotFacts(**{**base, **kw})  # type: ignore[arg-type]


def test_slot_outcome_process_death_is_at_once() -> None:
    assert slot_outcome(facts()) is None
    assert slot_outcome(facts(exit_code=3)) == ("exit", 3)
    assert slot_outcome(facts(stopping=True)) == ("stop", None)
    # The agent's connection closed: its workers died with it, even before the lease expires.
    assert slot_outcome(facts(liveness=Verdict.DEAD)) == ("node-gone", None)


def test_slot_outcome_suspect_waits_for_the_reset() -> None:
    # Only the agent may be frozen: its worker still trains, so no failure (no blacklist)...
    assert slot_outcome(facts(liveness=Verdict.SUSPECT)) is None
    assert slot_outcome(facts(record_present=False)) is None  # lease expired: same
    # ... nor when the world resets and the worker registers with the others (it is alive).
    assert slot_outcome(facts(liveness=Verdict.SUSPECT, reset_pending_s=3.0, registered=True)) is None
    # A reset in which it does not show up: the whole node is frozen or cut off.
    assert slot_outcome(facts(liveness=Verdict.SUSPECT, reset_pending_s=0.1)) is None  # grace
    assert slot_outcome(facts(liveness=Verdict.SUSPECT, reset_pending_s=0.6, reset_id=7)) == ("absent", 7)
    assert slot_outcome(facts(record_present=False, reset_pending_s=0.6, reset_id=7)) == ("absent", 7)
    # Every other worker of the world registered and it did not follow within PEER_GRACE_S: a live
    # one (only its agent frozen) was aborted with them and would be there; no need to wait longer.
    assert slot_outcome(facts(liveness=Verdict.SUSPECT, reset_pending_s=0.2, peers_registered_s=0.05)) is None
    assert slot_outcome(facts(liveness=Verdict.SUSPECT, reset_pending_s=0.2, peers_registered_s=0.2, reset_id=7)) == (
        "absent", 7)
    assert slot_outcome(facts(liveness=Verdict.SUSPECT, reset_pending_s=0.2, peers_registered_s=0.2,
                              registered=True)) is None
    # ... but never for a healthy node, however long the others have waited for it.
    assert slot_outcome(facts(reset_pending_s=0.2, peers_registered_s=5.0)) is None
    # Already out of the world (Horovod removed the host): the result is ignored by Horovod.
    assert slot_outcome(facts(liveness=Verdict.SUSPECT, assigned=False)) == ("left", None)
    # A healthy node with a reset pending is never failed by the driver.
    assert slot_outcome(facts(reset_pending_s=10.0)) is None


# ---- executor: real sockets --------------------------------------------------------------------
CLIENT = """
import sys, time
from elasticyolo.cluster.etcd import b64
from elasticyolo.cluster.liveness import LivenessClient
c = LivenessClient(sys.argv[1], 0.05, lambda: 0).start()
c.follow(sys.argv[2])
print("ready", flush=True)
time.sleep(600)
"""


def _client_process(node: str, endpoint: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", CLIENT, node, endpoint], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_server_sees_sigkill_at_once_and_sigstop_at_the_timeout() -> None:
    server = LivenessServer("127.0.0.1", timeout_s=0.5).start()
    seen: list[dict[str, Verdict]] = []
    server.add_listener(seen.append)
    procs = [_client_process(n, server.endpoint) for n in ("killed", "frozen", "healthy")]
    try:
        wait_for(lambda: all(server.verdict(n) is Verdict.ALIVE for n in ("killed", "frozen", "healthy")), 10,
                 "three clients alive")
        t0 = time.monotonic()
        procs[0].send_signal(signal.SIGKILL)
        wait_for(lambda: server.verdict("killed") is Verdict.DEAD, 5, "the killed client DEAD")
        dead_after = time.monotonic() - t0
        assert dead_after < 0.3, dead_after  # the kernel closed its socket: no timeout involved
        procs[1].send_signal(signal.SIGSTOP)
        t1 = time.monotonic()
        wait_for(lambda: server.verdict("frozen") is Verdict.SUSPECT, 5, "the frozen client SUSPECT")
        assert 0.4 < time.monotonic() - t1 < 1.5
        assert server.lost() == {"killed", "frozen"}
        wait_for(lambda: any(d.get("frozen") is Verdict.SUSPECT for d in seen), 5, "listeners told of the suspect")
        procs[1].send_signal(signal.SIGCONT)  # wrongly suspected: back with its next heartbeat
        wait_for(lambda: server.verdict("frozen") is Verdict.ALIVE, 5, "the frozen client back")
        assert server.verdict("healthy") is Verdict.ALIVE
        assert any(d.get("killed") is Verdict.DEAD for d in seen)
    finally:
        for p in procs:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
        server.stop()


def test_client_says_bye_when_it_moves_or_stops() -> None:
    a = LivenessServer("127.0.0.1", timeout_s=0.5).start()
    b = LivenessServer("127.0.0.1", timeout_s=0.5).start()
    c = LivenessClient("n1", 0.05, lambda: 0).start()
    try:
        c.follow(a.endpoint)
        wait_for(lambda: a.verdict("n1") is Verdict.ALIVE, 5, "n1 on a")
        c.follow(b.endpoint)  # a new leader: a deliberate move is no failure on the old one
        wait_for(lambda: b.verdict("n1") is Verdict.ALIVE, 5, "n1 on b")
        wait_for(lambda: a.verdict("n1") is Verdict.UNKNOWN, 5, "n1 gone from a without a verdict")
        c.stop()
        wait_for(lambda: b.verdict("n1") is Verdict.UNKNOWN, 5, "n1 gone from b without a verdict")
        assert not a.lost() and not b.lost()
    finally:
        c.stop()
        a.stop()
        b.stop()


# ---- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize("args,needle", [
    (["--heartbeat-timeout-s", "-1"], "heartbeat_timeout_s: Input should be greater than 0"),
    (["--heartbeat-interval-s", "0"], "heartbeat_interval_s: Input should be greater than 0"),
    (["--ttl", "2", "--heartbeat-timeout-s", "2"], "heartbeat_timeout_s: 2 s is not below the lease ttl (2 s)"),
    (["--heartbeat-interval-s", "1", "--heartbeat-timeout-s", "0.5"], "is not above heartbeat_interval_s"),
    (["--ttl", "1", "--heartbeat-interval-s", "0.9"], "heartbeat_interval_s: 0.9 s is not below the heartbeat timeout"),
])
def test_bad_heartbeat_settings_one_line(args: list[str], needle: str) -> None:
    r = subprocess.run([ELASTICYOLO, "agent", "--config", os.devnull, "--etcd", "127.0.0.1:9", *args],
                       capture_output=True, text=True, timeout=60)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (r.returncode, r.stderr)


def test_abort_targets_the_rest_of_the_world_only() -> None:
    from elasticyolo.engines.horovod.failures import abort_targets

    workers = [("a", 0), ("b", 0), ("b", 1), ("c", 0), ("old", 0)]
    # c is lost and in the world: every other worker of the world aborts its collective.
    assert abort_targets({"c"}, {"a", "b", "c"}, workers) == [("a", 0), ("b", 0), ("b", 1)]
    # A lost node outside the world (not yet joined, or removed already) costs the world nothing.
    assert abort_targets({"d"}, {"a", "b", "c"}, workers) == []


def test_a_connection_without_the_nodes_token_cannot_drop_it() -> None:
    import socket as _socket

    server = LivenessServer("127.0.0.1", timeout_s=0.5).start()
    try:
        spoof = _socket.create_connection(("127.0.0.1", server.port))
        spoof.sendall(b'{"hello": "x", "lease": 0, "token": "guess"}\n')
        wait_for(lambda: server.verdict("x") is Verdict.ALIVE, 5, "the claim registered")
        spoof.close()  # as if x had died
        wait_for(lambda: server.verdict("x") is Verdict.DEAD, 5, "the close seen")
        assert server.lost() == {"x"}
        # The driver asks with the tokens from the node records: a wrong token is no verdict.
        assert server.lost({"x": "the-real-token"}) == set()
        assert server.verdict("x", "the-real-token") is Verdict.UNKNOWN
        assert server.lost({"x": "guess"}) == {"x"}
    finally:
        server.stop()


# ---- the leader revokes a dead agent's lease, publishes a suspect (agent/dead_nodes.py) ---------
def test_only_a_dead_connection_with_the_records_token_revokes_as_leader() -> None:
    from elasticyolo.agent.dead_nodes import lease_to_revoke

    rec = {"liveness_token": "t1"}
    assert lease_to_revoke(Verdict.DEAD, "t1", rec, 42, leader=True) == 42
    assert lease_to_revoke(Verdict.SUSPECT, "t1", rec, 42, leader=True) is None  # may come back
    assert lease_to_revoke(Verdict.DEAD, "t1", rec, 42, leader=False) is None  # only the leader
    assert lease_to_revoke(Verdict.DEAD, "old", rec, 42, leader=True) is None  # another registration
    assert lease_to_revoke(Verdict.DEAD, None, rec, 42, leader=True) is None
    assert lease_to_revoke(Verdict.DEAD, "t1", None, 42, leader=True) is None  # record already gone
    assert lease_to_revoke(Verdict.DEAD, "t1", rec, 0, leader=True) is None


def test_only_a_leader_publishes_suspects_and_takes_them_back_when_it_stops_leading() -> None:
    from elasticyolo.agent.dead_nodes import suspect_writes

    assert suspect_writes({"a", "b"}, {"b", "c"}, leader=True) == ({"a"}, {"c"})
    assert suspect_writes({"a"}, set(), leader=False) == (set(), set())
    assert suspect_writes({"a"}, {"a", "c"}, leader=False) == (set(), {"a", "c"})


def test_leader_revokes_a_killed_agents_lease_at_once(etcd_server: Any) -> None:
    """Real etcd, a real liveness connection from a process that is SIGKILLed."""
    from elasticyolo.agent.dead_nodes import VerdictPublisher
    from elasticyolo.cluster.etcd import EtcdClient
    from elasticyolo.cluster.keys import JobKeys

    client = EtcdClient(etcd_server.endpoints)
    keys = JobKeys("reap")
    lease = client.lease_grant(60)
    client.put(keys.node("x"), json.dumps({"liveness_token": "tok"}), lease=lease)
    server = LivenessServer("127.0.0.1", timeout_s=5).start()
    reaper = VerdictPublisher(client, keys, server, is_leader=lambda: True).start()
    code = CLIENT.replace("lambda: 0)", "lambda: 0, token='tok')")
    child = subprocess.Popen([sys.executable, "-c", code, "x", server.endpoint], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        wait_for(lambda: server.verdict("x") is Verdict.ALIVE, 20, "the agent connected")
        child.kill()
        t0 = time.monotonic()
        wait_for(lambda: client.get(keys.node("x")) is None, 5, "the dead agent's record gone")
        assert time.monotonic() - t0 < 2, "revoked at once, not at the lease's 60 s"
        assert client.lease_ttl(lease) == -1
    finally:
        child.kill()
        reaper.stop()
        server.stop()


def test_leader_publishes_a_frozen_agent_as_suspect_until_it_beats_again(etcd_server: Any) -> None:
    """Real etcd, a real liveness connection from a process that is SIGSTOPped, then continued:
    the suspect key appears at the heartbeat timeout (under the leader's lease, fenced by its
    term) and goes with the next heartbeat; a connection with another token is never published."""
    from elasticyolo.agent.dead_nodes import VerdictPublisher
    from elasticyolo.cluster.etcd import EtcdClient
    from elasticyolo.cluster.keys import JobKeys

    client = EtcdClient(etcd_server.endpoints)
    keys = JobKeys("suspects")
    node_lease, leader_lease = client.lease_grant(60), client.lease_grant(60)
    client.put(keys.node("x"), json.dumps({"liveness_token": "tok"}), lease=node_lease)
    client.put(keys.node("y"), json.dumps({"liveness_token": "real"}), lease=node_lease)
    term = client.put(keys.leader, json.dumps({"node_id": "L"}), lease=leader_lease)
    fence = {"key": b64(keys.leader), "result": "EQUAL", "target": "MOD", "mod_revision": str(term)}
    server = LivenessServer("127.0.0.1", timeout_s=0.5).start()
    publisher = VerdictPublisher(client, keys, server, is_leader=lambda: True, fence=lambda: fence,
                                 lease=lambda: leader_lease, node_id="L").start()
    procs = []
    for node, token in (("x", "tok"), ("y", "spoofed")):
        code = CLIENT.replace("lambda: 0)", f"lambda: 0, token={token!r})")
        procs.append(subprocess.Popen([sys.executable, "-c", code, node, server.endpoint], stdout=subprocess.PIPE,
                                      text=True, env={**os.environ, "PYTHONPATH": str(REPO)}))
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        wait_for(lambda: server.verdict("x") is Verdict.ALIVE and server.verdict("y") is Verdict.ALIVE, 20,
                 "both connected")
        for p in procs:
            p.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        wait_for(lambda: client.get(keys.suspect("x")) is not None, 5, "the frozen agent published as a suspect")
        assert time.monotonic() - t0 < 2, "at the heartbeat timeout, not at the lease's 60 s"
        assert client.lease_of(keys.suspect("x")) == leader_lease
        assert client.get(keys.node("x")) is not None, "a suspect's lease is never revoked"
        wait_for(lambda: server.verdict("y") is Verdict.SUSPECT, 5, "the spoofing connection suspected")
        publisher.reconcile()
        assert client.get(keys.suspect("y")) is None, "its token is not the record's"
        for p in procs:
            p.send_signal(signal.SIGCONT)
        wait_for(lambda: client.get(keys.suspect("x")) is None, 5, "beats again: no longer a suspect")
    finally:
        for p in procs:
            p.kill()
        publisher.stop()
        server.stop()


# ---- a silent agent is no evidence against its worker (engines/horovod/failures.py) --------------
def test_a_suspect_is_lost_only_while_the_world_does_not_step() -> None:
    from elasticyolo.engines.world_health import lost_nodes, world_stalled

    verdicts = {"a": Verdict.ALIVE, "b": Verdict.SUSPECT, "c": Verdict.DEAD}
    assert lost_nodes(verdicts, stalled=False) == {"c"}  # b's agent is silent, but the world steps
    assert lost_nodes(verdicts, stalled=True) == {"b", "c"}
    # stalled: no advance of rank 0's step for 2.5 intervals, and at least a second
    assert world_stalled(None, None, 10.0)  # nothing shows the world steps
    assert not world_stalled(9.5, 0.5, 10.0)
    assert world_stalled(8.5, 0.5, 10.0)
    assert not world_stalled(8.0, 1.0, 10.0) and world_stalled(7.0, 1.0, 10.0)


def test_discovery_keeps_a_node_whose_record_vanished_for_a_grace() -> None:
    from elasticyolo.engines.horovod.discovery import Remembered, list_recent
    from elasticyolo.engines.world_health import note_step

    memory = Remembered()
    rec = {"state": "TRAINING", "slots": 1}
    assert list_recent({"a": rec, "b": rec}, memory, 0.0, grace_s=3.0) == {"a": rec, "b": rec}
    assert list_recent({"a": rec}, memory, 1.0, grace_s=3.0) == {"a": rec, "b": rec}  # b's lease lapsed
    assert list_recent({"a": rec, "b": rec}, memory, 2.0, grace_s=3.0) == {"a": rec, "b": rec}  # re-registered
    assert list_recent({"a": rec}, memory, 3.0, grace_s=3.0) == {"a": rec, "b": rec}
    assert list_recent({"a": rec}, memory, 5.5, grace_s=3.0) == {"a": rec, "b": rec}  # missing since 3.0
    assert list_recent({"a": rec}, memory, 6.5, grace_s=3.0) == {"a": rec}  # gone for good
    # a reader paused for longer than the grace starts counting when it reads again
    memory = Remembered()
    list_recent({"a": rec}, memory, 0.0, grace_s=3.0)
    assert list_recent({}, memory, 10.0, grace_s=3.0) == {"a": rec}
    # rank 0's step: when it last advanced, and how often
    for t, step in ((0.0, 10), (0.5, 12), (1.0, 12), (1.5, 14)):
        note_step(step, memory, t)
    assert memory.step == 14 and memory.step_changed_at == 1.5 and memory.step_period_s is not None
    note_step(3, memory, 2.0)  # a new submission starts over
    assert memory.step == 3 and memory.step_changed_at == 2.0
