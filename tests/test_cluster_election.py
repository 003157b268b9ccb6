"""Registry and election in-process against real etcd: fencing, atomic leader flags, lease loss."""

from __future__ import annotations

import json
import time

from elasticyolo.cluster.election import LeaderElection, read_leader
from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.registry import NodeIdTakenError, NodeRecord, NodeRegistration, read_nodes
from elasticyolo.errors import UnavailableError
from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.local_cluster.wait import wait_for


def node(e: EtcdClient, keys: JobKeys, node_id: str, preemptible: bool = True, ttl: int = 3) -> NodeRegistration:
    reg = NodeRegistration(e, keys, NodeRecord(node_id=node_id, host="h", addr="127.0.0.1", slots=1,
                                               preemptible=preemptible), ttl)
    reg.register()
    reg.start_keepalive()
    return reg


def test_register_keepalive_and_duplicate(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    keys = JobKeys(job_name)
    a = node(e, keys, "a", ttl=1)
    try:
        time.sleep(2.5)  # outlive the TTL twice: the keepalive thread must hold the key
        assert [r.node_id for r, _ in read_nodes(e, keys)] == ["a"]
        assert a.lease_valid() and 0 < a.seconds_left() <= 1
        dup = NodeRegistration(e, keys, NodeRecord(node_id="a", host="other", addr="x", slots=1), 1)
        try:
            dup.register()
            raise AssertionError("duplicate node id accepted")
        except NodeIdTakenError as exc:
            assert "already registered by host h" in str(exc)
        a.update(state="IDLE", notice={"action": "terminate"})
        rec = NodeRecord.from_json(e.get(keys.node("a"))[0])  # type: ignore[index]
        assert rec.state == "IDLE" and rec.notice == {"action": "terminate"}
    finally:
        assert a.leave() is True
    assert e.get(keys.node("a")) is None


def test_lease_loss_is_detected(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    keys = JobKeys(job_name)
    a = node(e, keys, "a", ttl=1)
    e.lease_revoke(a.lease_id)  # etcd forgets us (as after a long partition)
    wait_for(a.lease_lost, 3, "the keepalive loop to notice the lost lease")
    assert not a.lease_valid()
    a.stop_keepalive()


def test_election_fencing_and_atomic_flags(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    keys = JobKeys(job_name)
    ra, rb = node(e, keys, "a"), node(e, keys, "b")
    a, b = LeaderElection(e, keys, ra), LeaderElection(e, keys, rb)
    try:
        assert a.step([ra.record, rb.record]) is True
        assert b.step([ra.record, rb.record]) is False and b.leader is not None and b.leader.node_id == "a"
        info = read_leader(e, keys)
        assert info is not None and info.node_id == "a" and info.term == a.term
        flags = {r.node_id: r.leader for r, _ in read_nodes(e, keys)}
        assert flags == {"a": True, "b": False}
        assert a.fenced_put(keys.world, json.dumps({"world_size": 2}))
        term_a = a.term

        # a's term ends behind its back (as when its lease expires while it is partitioned away)
        e.delete(keys.leader)
        assert b.step([]) is True and b.term > term_a
        assert a.fenced_put(keys.world, "stale write from a deposed leader") is False
        assert json.loads(e.get(keys.world)[0]) == {"world_size": 2}  # type: ignore[index]
        assert a.step([]) is False  # a notices and steps down
        flags = {r.node_id: r.leader for r, _ in read_nodes(e, keys)}
        assert flags == {"a": False, "b": True}

        b.resign("test")
        assert read_leader(e, keys) is None and not b.is_leader
        assert {r.node_id: r.leader for r, _ in read_nodes(e, keys)} == {"a": False, "b": False}
    finally:
        ra.leave()
        rb.leave()


def test_preemptible_defers_and_hands_over(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    keys = JobKeys(job_name)
    rs, ro = node(e, keys, "spot", preemptible=True), node(e, keys, "ondemand", preemptible=False)
    spot, ondemand = LeaderElection(e, keys, rs), LeaderElection(e, keys, ro)
    try:
        assert spot.step([rs.record]) is True  # alone: a preemptible node leads
        assert spot.step([rs.record, ro.record]) is False  # hands over once a stable node is there
        assert spot.step([rs.record, ro.record]) is False  # and does not campaign against it
        assert ondemand.step([rs.record, ro.record]) is True
    finally:
        rs.leave()
        ro.leave()


def test_keepalive_is_independent_of_the_agents_slow_requests(etcd_server: EtcdCluster, job_name: str) -> None:
    """The agent's own requests may hang (a loaded etcd, a stuck member): the lease is renewed on
    a connection of its own, so the node is never evicted for that."""
    import socket
    import threading

    hole = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    keys = JobKeys(job_name)
    real = EtcdClient(etcd_server.endpoints)
    stuck = EtcdClient(f"127.0.0.1:{hole.getsockname()[1]}", timeout=30, retry_window=30)
    reg = NodeRegistration(real, keys, NodeRecord(node_id="a", host="h", addr="127.0.0.1", slots=1), 1,
                           keepalive_client=EtcdClient(etcd_server.endpoints))
    reg.register()
    reg.client = stuck  # from now on every request of "the agent" hangs
    reg.start_keepalive()
    def hang() -> None:
        try:
            reg.update(state="TRAINING")
        except UnavailableError:
            pass  # the hole closes when the test ends: the request fails then, as it should

    hung = threading.Thread(target=hang, daemon=True)
    hung.start()
    try:
        time.sleep(3.5)  # three TTLs with the agent's writer stuck
        assert hung.is_alive(), "the agent's request did not hang: the test proves nothing"
        assert reg.lease_valid() and not reg.lease_lost()
        assert [r.node_id for r, _ in read_nodes(real, keys)] == ["a"]
    finally:
        reg.stop_keepalive()
        real.lease_revoke(reg.lease_id)
        hole.close()


def test_a_follower_waits_for_a_leader_whose_lease_lapsed_to_take_its_lead_back() -> None:
    from elasticyolo.cluster.election import defers_to_previous_leader

    assert defers_to_previous_leader(True, key_gone_s=1.0, grace_s=4.0, reachable=True)
    assert not defers_to_previous_leader(True, key_gone_s=4.5, grace_s=4.0, reachable=True)  # it did not
    assert not defers_to_previous_leader(True, key_gone_s=0.1, grace_s=4.0, reachable=False)  # it died
    assert not defers_to_previous_leader(False, key_gone_s=0.1, grace_s=4.0, reachable=True)  # it was us
