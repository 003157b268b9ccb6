"""Contract of the etcd v3 rendezvous backend, its c10d store and handler, against a real etcd."""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time
from datetime import timedelta
from typing import Iterator

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous.api import (  # noqa: E402
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (  # noqa: E402
    DynamicRendezvousHandler,
)

from elasticyolo.cluster.etcd import EtcdClient  # noqa: E402
from elasticyolo.engines.torch.rendezvous import (  # noqa: E402
    EtcdRendezvousBackend,
    EtcdRendezvousHandler,
    EtcdStore,
    create_handler,
)
from elasticyolo.local_cluster.wait import in_threads, wait_for  # noqa: E402


@pytest.fixture
def backend(etcd_server, job_name) -> EtcdRendezvousBackend:
    b = EtcdRendezvousBackend(etcd_server.endpoints, job_name)
    b.clear()
    return b


def test_absent_state_is_none(backend: EtcdRendezvousBackend) -> None:
    assert backend.name == "etcd3"
    assert backend.get_state() is None


def test_first_set_creates_and_set_without_token_never_overwrites(backend: EtcdRendezvousBackend) -> None:
    state, token, ok = backend.set_state(b"first")  # type: ignore[misc]
    assert (state, ok) == (b"first", True)
    assert backend.get_state() == (b"first", token)
    assert backend.set_state(b"second") == (b"first", token, False)
    assert backend.get_state() == (b"first", token)


def test_set_with_current_token_replaces_and_returns_new_token(backend: EtcdRendezvousBackend) -> None:
    _, t1, _ = backend.set_state(b"v1")  # type: ignore[misc]
    state, t2, ok = backend.set_state(b"v2", t1)  # type: ignore[misc]
    assert (state, ok) == (b"v2", True) and t2 != t1
    assert backend.get_state() == (b"v2", t2)
    # The token is the key's mod revision, as etcd reports it.
    assert backend.client.get(backend.key)[1] == t2  # type: ignore[index]


@pytest.mark.parametrize("bad", ["old", "str-old", "garbage", b"\x00bytes", -3, 0, 1.5, object()])
def test_set_with_old_or_invalid_token_changes_nothing(backend: EtcdRendezvousBackend, bad: object) -> None:
    _, t1, _ = backend.set_state(b"v1")  # type: ignore[misc]
    _, t2, _ = backend.set_state(b"v2", t1)  # type: ignore[misc]
    token = {"old": t1, "str-old": str(t1), "garbage": "not-a-revision"}.get(bad, bad)  # type: ignore[call-overload]
    assert backend.set_state(b"evil", token) == (b"v2", t2, False)
    assert backend.get_state() == (b"v2", t2)


def test_token_as_decimal_text_is_accepted(backend: EtcdRendezvousBackend) -> None:
    _, t1, _ = backend.set_state(b"v1")  # type: ignore[misc]
    assert backend.set_state(b"v2", str(t1))[1:] != (t1, False)  # type: ignore[index]
    assert backend.get_state()[0] == b"v2"  # type: ignore[index]


def test_set_with_token_when_absent_returns_none(backend: EtcdRendezvousBackend) -> None:
    assert backend.set_state(b"x", 12345) is None
    assert backend.set_state(b"x", "junk") is None
    assert backend.get_state() is None


@pytest.mark.parametrize("junk", [b"", b"hello", b"eyrdzv1 00000000 ab !!notbase64", b"eyrdzv1 deadbeef ab aGVsbG8=", b"eyrdzv1 3610a686 aGVsbG8="])
def test_corrupt_state_raises_state_error(backend: EtcdRendezvousBackend, junk: bytes) -> None:
    backend.client.put(backend.key, junk)
    with pytest.raises(RendezvousStateError):
        backend.get_state()
    rev = backend.client.get(backend.key)[1]  # type: ignore[index]
    with pytest.raises(RendezvousStateError):
        backend.set_state(b"x", rev - 1)  # loses the CAS, then decodes what is there


def test_unreachable_etcd_raises_connection_error(job_name: str) -> None:
    from elasticyolo.local_cluster.servers import free_port

    b = EtcdRendezvousBackend(f"127.0.0.1:{free_port()}", job_name, retry_window=0.3, timeout=0.5)
    with pytest.raises(RendezvousConnectionError):
        b.get_state()
    with pytest.raises(RendezvousConnectionError):
        b.set_state(b"x")


def test_sigterm_during_a_request_stays_a_sigterm() -> None:
    # torch's launcher turns SIGTERM into SignalException; raised inside an etcd request it must
    # not become a connection error (the launcher then took its error path: see membership.py).
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    def interrupted() -> None:
        raise SignalException("got signal: 15", sigval=signal.SIGTERM)

    with pytest.raises(SignalException):
        EtcdRendezvousBackend._call(interrupted)


def _increment(endpoints: str, run_id: str, times: int, q: "mp.Queue[int]") -> None:
    b = EtcdRendezvousBackend(endpoints, run_id)
    conflicts = 0
    for _ in range(times):
        while True:
            current = b.get_state()
            assert current is not None
            value = pickle.loads(current[0])
            result = b.set_state(pickle.dumps(value + 1), current[1])
            assert result is not None
            if result[2]:
                break
            conflicts += 1
    q.put(conflicts)


def test_concurrent_cas_from_processes_loses_no_update(backend: EtcdRendezvousBackend, etcd_server) -> None:
    backend.set_state(pickle.dumps(0))
    ctx = mp.get_context("fork")  # no torch re-import per child; the children only talk HTTP
    q: mp.Queue[int] = ctx.Queue()
    procs = [ctx.Process(target=_increment, args=(etcd_server.endpoints, backend.run_id, 25, q)) for _ in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    conflicts = sum(q.get(timeout=5) for _ in procs)
    state = backend.get_state()
    assert state is not None and pickle.loads(state[0]) == 100
    assert conflicts > 0, "the processes never raced; the test proves nothing"


# ---- store ----------------------------------------------------------------------------------

@pytest.fixture(params=[False, True], ids=["polled", "watched"])
def store(request, etcd_server, job_name) -> Iterator[EtcdStore]:
    client = EtcdClient(etcd_server.endpoints)
    client.delete_prefix(f"/t/{job_name}/")
    s = EtcdStore(client, f"/t/{job_name}/store", timeout=timedelta(seconds=3), watch=request.param)
    yield s
    s.close()


def test_a_watched_store_wakes_on_the_write_not_on_a_poll(etcd_server, job_name, monkeypatch) -> None:
    """With a re-read only every 30 s, a waiting get still returns as the key is written: the
    watch woke it."""
    monkeypatch.setattr(EtcdStore, "_WATCH_POLL_S", 30.0)
    monkeypatch.setattr(EtcdStore, "_ABORT_CHECK_S", 30.0)
    client = EtcdClient(etcd_server.endpoints)
    s = EtcdStore(client, f"/t/{job_name}/store", timeout=timedelta(seconds=20), watch=True)
    try:
        threading.Timer(0.3, EtcdStore(client, f"/t/{job_name}/store").set, ("late", b"v")).start()
        t0 = time.monotonic()
        assert s.get("late") == b"v"
        assert time.monotonic() - t0 < 10, "woke only at a re-read"
    finally:
        s.close()


def test_store_set_get_add_compare_set(store: EtcdStore) -> None:
    p = dist.PrefixStore("round.1", store)  # how torch uses it (through the C++ trampoline)
    p.set("a", "1")
    assert p.get("a") == b"1"
    assert p.add("n", 2) == 2 and p.add("n", 3) == 5
    p.multi_set(["x", "y"], ["X", "Y"])
    assert p.multi_get(["x", "y"]) == [b"X", b"Y"]
    assert p.compare_set("c", "", "new") == b"new"
    assert p.compare_set("c", "wrong", "other") == b"new"
    assert p.compare_set("c", "new", "third") == b"third"
    assert p.compare_set("absent", "expected", "v") == b"expected"
    assert p.check(["a", "x"]) and not p.check(["nope"])
    assert store.num_keys() == 5  # a, n, x, y, c
    assert p.delete_key("a") and not p.check(["a"])


def test_store_get_blocks_until_set_and_times_out(store: EtcdStore) -> None:
    threading.Timer(0.3, store.set, ("late", b"v")).start()
    t0 = time.monotonic()
    assert store.get("late") == b"v"
    assert 0.2 < time.monotonic() - t0 < 2
    with pytest.raises(Exception):
        store.wait(["never"], timedelta(seconds=0.3))
    store.set_timeout(timedelta(seconds=0.3))
    with pytest.raises(Exception):
        store.get("never")


def test_store_concurrent_add_is_atomic(store: EtcdStore) -> None:
    threads = [threading.Thread(target=lambda: [store.add("ctr", 1) for _ in range(15)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.get("ctr") == b"60"


# ---- handler --------------------------------------------------------------------------------

def _params(endpoints: str, run_id: str, **conf: object) -> RendezvousParameters:
    conf = {"join_timeout": 20, "last_call_timeout": 1, "keep_alive_interval": 1, "read_timeout": 4, **conf}
    return RendezvousParameters("etcd3", endpoints, run_id, 1, 4, local_addr="127.0.0.1", **conf)


def _rendezvous_all(handlers: list) -> list:
    """Every handler's next round, concurrently: its RendezvousInfo or the exception it raised."""
    return in_threads(lambda i: handlers[i].next_rendezvous(), len(handlers), 30 * len(handlers))


def _scale_up(endpoints: str, run_id: str, handler_cls: type) -> tuple[list, list]:
    params = _params(endpoints, run_id)
    EtcdRendezvousBackend(endpoints, run_id).clear()
    made = [create_handler(params) for _ in range(3)]
    handlers = [handler_cls(h._this_node, h._settings, h._backend_name, h._store, h._state_holder) for h in made]
    first = _rendezvous_all(handlers[:2])
    # A third node joins: the running ones see it waiting and all re-rendezvous.
    late = threading.Thread(target=lambda: second.append(handlers[2].next_rendezvous_safe()))
    second: list = []
    handlers[2].next_rendezvous_safe = lambda: _safe(handlers[2])  # type: ignore[attr-defined]
    late.start()
    wait_for(lambda: handlers[0].num_nodes_waiting() > 0, 10, "the running nodes to see the third one waiting")
    rest = _rendezvous_all(handlers[:2])
    late.join(30)
    for h in handlers:
        h.shutdown()
    return first, rest + second


def _safe(h):  # type: ignore[no-untyped-def]
    try:
        return h.next_rendezvous()
    except Exception as exc:  # noqa: BLE001
        return exc


def test_handler_scale_up_gets_fresh_store_each_round(etcd_server, job_name: str) -> None:
    first, second = _scale_up(etcd_server.endpoints, job_name, EtcdRendezvousHandler)
    assert all(not isinstance(r, Exception) for r in first + second), first + second
    assert sorted(r.rank for r in first) == [0, 1] and {r.world_size for r in first} == {2}
    assert sorted(r.rank for r in second) == [0, 1, 2] and {r.world_size for r in second} == {3}
    addrs = {(r.bootstrap_store_info.master_addr, r.bootstrap_store_info.master_port) for r in second}
    assert len(addrs) == 1, addrs  # everyone agrees on this round's store
    assert addrs != {(first[0].bootstrap_store_info.master_addr, first[0].bootstrap_store_info.master_port)}


def test_stock_handler_hangs_on_scale_up(etcd_server, job_name: str) -> None:
    """Why EtcdRendezvousHandler exists: the stock handler makes the newcomer wait for
    MASTER_ADDR that nobody publishes in the new round (here it times out after read_timeout)."""
    _, second = _scale_up(etcd_server.endpoints, job_name, DynamicRendezvousHandler)
    errors = [r for r in second if isinstance(r, Exception)]
    assert len(errors) == 1 and "MASTER_ADDR" in str(errors[0]), second


def test_expelled_node_is_told_to_rejoin(etcd_server, job_name: str) -> None:
    """A node dropped from its round (late heartbeats) must not keep training alone."""
    params = _params(etcd_server.endpoints, job_name)
    backend = EtcdRendezvousBackend(etcd_server.endpoints, job_name)
    backend.clear()
    handlers = [create_handler(params) for _ in range(2)]
    try:
        assert all(not isinstance(r, Exception) for r in _rendezvous_all(handlers))
        assert [h.num_nodes_waiting() for h in handlers] == [0, 0]
        raw, token = backend.get_state()  # type: ignore[misc]
        state = pickle.loads(raw)
        del state.participants[handlers[0]._this_node]  # what the sanitizer does to a "dead" node
        assert backend.set_state(pickle.dumps(state), token)[2]  # type: ignore[index]
        # The state holder serves a 1 s cache: the expelled node learns it on the next refresh.
        wait_for(lambda: handlers[0].num_nodes_waiting() >= 1, 5, "the expelled node to be told to rejoin")
        assert handlers[1].num_nodes_waiting() == 0
    finally:
        for h in handlers:
            h.shutdown()


def test_store_wait_on_a_dead_peer_is_abandoned_and_the_rendezvous_stays_open(etcd_server, job_name: str) -> None:
    """A node killed right after its round formed never writes its keys (torch's rank assignment
    waits for every agent's role_info). The wait ends once the peer is seen dead, well before the
    read timeout, and the failing agent's shutdown leaves the rendezvous open: closing it would
    end the job on every node (as the stock handler does)."""
    params = _params(etcd_server.endpoints, job_name, read_timeout=60)
    backend = EtcdRendezvousBackend(etcd_server.endpoints, job_name)
    backend.clear()
    handlers = [create_handler(params) for _ in range(2)]
    try:
        assert all(not isinstance(r, Exception) for r in _rendezvous_all(handlers))
        round_ = handlers[0]._joined_round
        handlers[1]._stop_heartbeats()  # killed: no more heartbeats, no keys
        key = f"torch.rendezvous.{job_name}.{round_}/torchelastic/role_info/1"
        t0 = time.monotonic()
        with pytest.raises(LookupError, match="gave up waiting"):
            handlers[0]._store.get(key)
        assert time.monotonic() - t0 < 15  # heartbeat expiry here: 3 s; read timeout: 60 s
        try:
            raise LookupError("what the agent raised")
        except LookupError:
            assert handlers[0].shutdown() is False  # an error exit: not closed
        assert pickle.loads(backend.get_state()[0]).closed is False  # type: ignore[index]
        # A live peer's key is still waited for as usual.
        handlers[0]._store.set(f"torch.rendezvous.{job_name}.{round_ + 5}/k", b"v")
        assert handlers[0]._store.get(f"torch.rendezvous.{job_name}.{round_ + 5}/k") == b"v"
    finally:
        for h in handlers:
            h._stop_heartbeats()
    assert create_handler(params).shutdown() is True  # a clean end closes it
    assert pickle.loads(backend.get_state()[0]).closed is True  # type: ignore[index]


def test_a_stop_signal_swallowed_on_the_way_is_raised_again_at_the_next_monitor_tick(
        etcd_server, job_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """launcher_signal.py: torch stops its launcher by raising SignalException from the signal
    handler; a broad `except` it happens to interrupt swallows it. Seen in CI: a node drained on a
    spot notice kept its launcher training 17 s, until the drain deadline. The agent's monitor loop
    (`num_nodes_waiting`, every tick) raises it again; a rendezvous sync does not swallow it."""
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from elasticyolo.engines.torch import launcher_signal
    from elasticyolo.engines.torch.membership import RendezvousView

    monkeypatch.setattr(launcher_signal, "_received", None)
    from elasticyolo.cluster.keys import JobKeys

    params = _params(etcd_server.endpoints, job_name, node_id="a", job=job_name)
    backend = EtcdRendezvousBackend(etcd_server.endpoints, job_name)
    backend.clear()
    backend.client.put(JobKeys(job_name).nodes + "a", "{}")  # node a's agent has registered it
    handler = create_handler(params)
    try:
        assert not isinstance(_rendezvous_all([handler])[0], Exception)
        assert handler.num_nodes_waiting() == 0
        try:
            launcher_signal.on_signal(signal.SIGTERM, None)
        except Exception:  # noqa: BLE001 - what a broad `except` on the main thread does with it
            pass
        with pytest.raises(SignalException, match="raised again"):
            handler.num_nodes_waiting()
        monkeypatch.setattr(launcher_signal, "_received", None)

        def interrupted(self: RendezvousView) -> None:
            raise SignalException("got signal: 15", sigval=signal.SIGTERM)

        monkeypatch.setattr(RendezvousView, "read", interrupted)
        handler._state_holder.changed = True  # the next tick reads etcd: SIGTERM arrives in that read
        with pytest.raises(SignalException):
            handler.num_nodes_waiting()
    finally:
        monkeypatch.undo()
        handler.shutdown()
