"""The etcd wrapper against a real etcd on 127.0.0.1: kv, CAS, leases, watch, failover, errors."""

from __future__ import annotations

import threading
import time

import pytest

from elasticyolo.cluster.etcd import EtcdClient, LeaseNotFoundError, WatchEvent, parse_endpoints
from elasticyolo.errors import UnavailableError, UserError
from elasticyolo.local_cluster.servers import EtcdCluster, free_port
from elasticyolo.local_cluster.wait import wait_for


def test_kv_roundtrip_and_prefix(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    p = f"/elasticyolo/{job_name}/"
    rev = e.put(p + "a", b"\x00\xffbin")
    assert e.get(p + "a") == (b"\x00\xffbin", rev)
    e.put(p + "b", "text é")
    assert e.get(p + "missing") is None
    rows = e.get_prefix(p)
    assert [(k, v) for k, v, _ in rows] == [(p + "a", b"\x00\xffbin"), (p + "b", "text é".encode())]
    assert e.get_many([p + "a", p + "zz"])[p + "zz"] is None
    assert e.delete(p + "a") is True and e.delete(p + "a") is False
    assert e.delete_prefix(p) == 1
    assert e.get_prefix(p) == []
    e.close()


def test_compare_and_swap(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    k = f"/elasticyolo/{job_name}/cas"
    ok, cur = e.compare_and_swap(k, "v1", 0)
    assert ok and cur is not None and cur[0] == b"v1"
    ok2, cur2 = e.compare_and_swap(k, "v2", 0)
    assert not ok2 and cur2 == cur  # create-only fails and reports what is there
    ok3, cur3 = e.compare_and_swap(k, "v3", cur[1])
    assert ok3 and cur3 is not None and cur3[0] == b"v3" and cur3[1] > cur[1]
    ok4, _ = e.compare_and_swap(k, "stale", cur[1])
    assert not ok4 and e.get(k) == cur3
    assert e.delete_if_mod_revision(k, cur[1]) is False
    assert e.delete_if_mod_revision(k, cur3[1]) is True
    ok5, cur5 = e.compare_and_swap(k, "x", 12345)
    assert not ok5 and cur5 is None


def test_leases(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    k = f"/elasticyolo/{job_name}/leased"
    lease = e.lease_grant(5)
    assert 0 < e.lease_ttl(lease) <= 5
    e.put(k, "x", lease=lease)
    assert e.lease_of(k) == lease
    assert e.lease_refresh(lease) == 5
    assert e.lease_revoke(lease) is True
    assert e.get(k) is None  # revoking deletes attached keys at once
    assert e.lease_ttl(lease) == -1
    assert e.lease_revoke(lease) is False
    with pytest.raises(LeaseNotFoundError):
        e.lease_refresh(lease)


def test_lease_expiry_removes_key(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    k = f"/elasticyolo/{job_name}/short"
    e.put(k, "x", lease=e.lease_grant(1))
    wait_for(lambda: e.get(k) is None, 4, "the leased key to go with its 1 s TTL")


def test_watch_prefix_sees_puts_and_deletes(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    p = f"/elasticyolo/{job_name}/w/"
    start = e.revision() + 1
    events: list[WatchEvent] = []
    it, cancel = e.watch_prefix(p, start_revision=start)
    t = threading.Thread(target=lambda: events.extend(it), daemon=True)
    t.start()
    e.put(p + "x", "1")
    e.put(f"/elasticyolo/{job_name}/outside", "no")
    e.delete(p + "x")
    wait_for(lambda: len(events) >= 2, 5, "the put and the delete to be watched")
    cancel()
    t.join(3)
    assert not t.is_alive(), "cancel() did not end the watch iterator"
    assert [(ev.type, ev.key, ev.value) for ev in events] == [("PUT", p + "x", b"1"), ("DELETE", p + "x", b"")]


def test_failover_when_first_endpoint_dies(etcd_cluster3: EtcdCluster, job_name: str) -> None:
    c = etcd_cluster3
    e = EtcdClient(c.endpoints, timeout=1.0)
    k = f"/elasticyolo/{job_name}/f"
    e.put(k, "before")
    lease = e.lease_grant(10)
    c.kill_member(c.members[0])
    # Every call keeps working through the surviving members (retries cover an etcd election).
    assert e.get(k) is not None and e.get(k)[0] == b"before"  # type: ignore[index]
    e.put(k, "after")
    assert e.lease_refresh(lease) == 10
    assert e.get(k)[0] == b"after"  # type: ignore[index]
    # A fresh client that lists the dead member first also works.
    assert EtcdClient(c.endpoints).get(k)[0] == b"after"  # type: ignore[index]


def test_watch_survives_member_death(etcd_cluster3: EtcdCluster, job_name: str) -> None:
    c = etcd_cluster3
    e = EtcdClient(c.endpoints, timeout=1.0)
    p = f"/elasticyolo/{job_name}/w/"
    events: list[WatchEvent] = []
    it, cancel = e.watch_prefix(p, start_revision=e.revision() + 1)
    threading.Thread(target=lambda: events.extend(it), daemon=True).start()
    e.put(p + "1", "a")
    c.kill_member(c.members[0])
    e.put(p + "2", "b")
    wait_for(lambda: len(events) >= 2, 8, "both puts to be watched across the member's death")
    cancel()
    assert [ev.key for ev in events] == [p + "1", p + "2"]


def test_unreachable_is_one_line_naming_endpoints() -> None:
    dead = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    e = EtcdClient(dead, retry_window=0.3)
    t0 = time.monotonic()
    with pytest.raises(UnavailableError) as err:
        e.get("/x")
    assert time.monotonic() - t0 < 3
    msg = str(err.value)
    assert "\n" not in msg and "etcd unreachable" in msg
    for ep in dead.split(","):
        assert ep in msg


def test_parse_endpoints() -> None:
    assert parse_endpoints("a:1, https://b:2 ,c", tls=False) == [("http", "a", 1), ("https", "b", 2), ("http", "c", 2379)]
    assert parse_endpoints(["a:1"], tls=True) == [("https", "a", 1)]
    for bad in ("", "a:notaport", "ftp://a:1", "a:0"):
        with pytest.raises(UserError):
            parse_endpoints(bad, tls=False)
