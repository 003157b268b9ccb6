"""Horovod's worker registry without its double count (engines/horovod/registry.py), stepped with
real threads against a stand-in driver and host manager (Horovod's registry itself is real)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest

from elasticyolo.engines.horovod.registry import GuardedWorkerRegistry
from elasticyolo.local_cluster.wait import wait_for


class Hosts:
    def __init__(self) -> None:
        self.blacklisted: set[str] = set()

    def is_blacklisted(self, host: str) -> bool:
        return host in self.blacklisted

    def blacklist(self, host: str) -> None:
        self.blacklisted.add(host)


class Driver:
    """Resumes with the next world size, as Horovod's `_activate_workers` resets the registry."""

    def __init__(self) -> None:
        self.registry: GuardedWorkerRegistry | None = None
        self.next_size = 2
        self.resumed: list[set[tuple[str, int]]] = []  # who had registered when each reset completed
        self.forgotten: list[set[tuple[str, int]]] = []  # the failed slots started again by each resume

    def finished(self) -> bool:
        return False

    def stop(self, error_message: Any = None) -> None:
        raise AssertionError(f"the job must not stop: {error_message}")

    def forget_slots(self, slots: set[tuple[str, int]]) -> None:
        self.forgotten.append(set(slots))

    def discover_now(self) -> None:
        pass

    def resume(self) -> None:
        assert self.registry is not None
        self.resumed.append(set(self.registry.get_recorded_slots()))
        self.registry.reset(self.next_size)


@pytest.fixture
def setup() -> tuple[GuardedWorkerRegistry, Driver, Hosts]:
    driver, hosts = Driver(), Hosts()
    registry = GuardedWorkerRegistry(driver, hosts)
    driver.registry = registry
    registry.reset(3)
    return registry, driver, hosts


def register(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["id"] = fn()
        except Exception as exc:  # noqa: BLE001 - what the rendezvous handler's thread would raise
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_worker_counted_out_that_registered_after_all_is_not_failed(setup: tuple) -> None:
    registry, driver, hosts = setup
    first = registry.last_rendezvous()
    waiting = [register(lambda h=h: registry.record_ready(h, 0)) for h in ("a", "b")]
    wait_for(lambda: registry._barrier.n_waiting == 2, 5, "a and b at the barrier")
    # The orphan (only its agent was frozen) registers just before the driver's absence verdict lands.
    orphan = register(lambda: registry.record_ready("x", 0))
    wait_for(lambda: len(driver.resumed) == 1, 5, "the reset to complete with all three")
    assert registry.record_failure_if_absent("x", 0, first) is None
    for t, out in [*waiting, orphan]:
        t.join(5)
        assert out == {"id": first}
    assert not hosts.blacklisted


def test_a_worker_still_absent_is_failed_but_its_host_not_blacklisted(setup: tuple) -> None:
    # Absence from a reset is no evidence that the host is broken (round_policy.py): the slot is
    # recorded failed, the world resumes without it, and the host may come back.
    registry, driver, hosts = setup
    first = registry.last_rendezvous()
    waiting = [register(lambda h=h: registry.record_ready(h, 0)) for h in ("a", "b")]
    wait_for(lambda: registry._barrier.n_waiting == 2, 5, "a and b at the barrier")
    failed = register(lambda: registry.record_failure_if_absent("x", 0, first))
    for t, out in [*waiting, failed]:
        t.join(5)
        assert out == {"id": first}
    assert hosts.blacklisted == set() and driver.resumed == [{("a", 0), ("b", 0), ("x", 0)}]
    # A verdict about a reset that is over is not recorded in the next one.
    assert registry.record_failure_if_absent("x", 0, first) is None
    assert not registry.get_recorded_slots()


def test_a_repeated_registration_does_not_complete_the_reset_without_a_member(setup: tuple) -> None:
    registry, driver, hosts = setup
    a = register(lambda: registry.record_ready("a", 0))
    x_ready = register(lambda: registry.record_ready("x", 0))
    wait_for(lambda: registry._barrier.n_waiting == 2, 5, "a and x at the barrier")
    # x is counted failed while its READY request waits: that request's handler fails (Horovod) and
    # the worker retries its GET: a second READY of the same slot in the same reset.
    x_failed = register(lambda: registry.record_failure("x", 0))
    x_ready[0].join(5)
    assert isinstance(x_ready[1].get("error"), RuntimeError)
    x_retry = register(lambda: registry.record_ready("x", 0))
    # The retry waits for the reset to complete (on the registry's condition), not at the barrier.
    wait_for(lambda: len(registry._round_changed._waiters) == 1, 5, "x's retry to wait for the reset")  # type: ignore[attr-defined]
    # a's registration re-enters the barrier after its reset (the count dips meanwhile): wait for it.
    wait_for(lambda: registry._barrier.n_waiting == 2, 5, "a and x's failure at the barrier")
    assert not driver.resumed, "the retry counted as b"
    b = register(lambda: registry.record_ready("b", 0))
    for t, _ in (a, x_failed, b, x_retry):
        t.join(5)
        assert not t.is_alive()
    assert driver.resumed == [{("a", 0), ("b", 0), ("x", 0)}] and hosts.blacklisted == set()
    assert x_retry[1] == {"id": registry.last_rendezvous()}  # answered after the new world was set up


def test_a_host_whose_worker_alone_crashes_twice_is_blacklisted(setup: tuple) -> None:
    registry, driver, hosts = setup
    driver.next_size = 3
    for round_no in range(2):
        assert not hosts.blacklisted
        ready = [register(lambda h=h: registry.record_ready(h, 0)) for h in ("a", "b")]
        wait_for(lambda: registry._barrier.n_waiting == 2, 5, "a and b at the barrier")
        registry.note_crash("x", 0)
        crashed = register(lambda: registry.record_failure("x", 0))
        for t, _ in (*ready, crashed):
            t.join(5)
        wait_for(lambda n=round_no: len(driver.resumed) == n + 1, 5, "the reset to complete")
    assert hosts.blacklisted == {"x"} and registry.blacklisted == ["x"]
    assert driver.forgotten == [{("x", 0)}, {("x", 0)}]  # each resume starts the failed worker again
