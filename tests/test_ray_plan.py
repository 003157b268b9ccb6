"""engine=ray without a cluster: the controller's pure cluster decisions (`engines/ray/plan.py`)
stepped through a job's life, and the one-line errors of bad input."""

from __future__ import annotations

import subprocess
import sys

import pytest

from elasticyolo.engines.ray.plan import ClusterInputs, HeldNode, Slot, plan_cluster
from elasticyolo.errors import UserError

E, R, L, X = Slot.EMPTY, Slot.RUNNING, Slot.LEAVING, Slot.ENDED


def step(held: dict[str, HeldNode], alive: set[str], pending: bool = False, max_nodes: int = 4, ended: bool = False):
    return plan_cluster(ClusterInputs(held=held, alive=frozenset(alive), pending=pending, max_nodes=max_nodes,
                                      ended=ended))


def test_a_job_asks_for_one_node_at_a_time_and_fills_the_slots_of_each() -> None:
    assert step({}, set()).ask_for_node  # nothing held: ask
    assert not step({}, set(), pending=True).ask_for_node  # one pending placement group at a time
    got = step({"a": HeldNode("A", (E, E))}, {"A"})
    assert got.start == (("a", 0), ("a", 1)) and got.ask_for_node and not got.release
    full = step({"a": HeldNode("A", (R,)), "b": HeldNode("B", (R,))}, {"A", "B"}, max_nodes=2)
    assert full == type(full)()  # at max_nodes, everything running: nothing to do


def test_a_dead_node_is_let_go_and_its_members_are_lost() -> None:
    got = step({"a": HeldNode("A", (R,)), "b": HeldNode("B", (R,))}, {"A"})
    assert got.release == ("b",) and got.lost == {"b"} and got.ask_for_node
    frozen = step({"a": HeldNode("A", (R,)), "b": HeldNode("B", (R,), lost=True)}, {"A", "B"})
    assert frozen.release == ("b",) and frozen.lost == {"b"}


def test_a_worker_that_died_on_a_live_node_is_replaced_in_its_bundle() -> None:
    got = step({"a": HeldNode("A", (R, E))}, {"A"}, max_nodes=1)
    assert got.start == (("a", 1),) and not got.release and not got.lost


def test_a_draining_node_is_asked_to_leave_once_then_let_go_and_not_replaced_by_itself() -> None:
    draining = step({"a": HeldNode("A", (R,)), "b": HeldNode("B", (R,), draining=True)}, {"A", "B"}, max_nodes=2)
    assert draining.leave == (("b", 0),) and not draining.start and draining.ask_for_node  # a replacement node
    asked = step({"a": HeldNode("A", (R,)), "b": HeldNode("B", (L,), draining=True)}, {"A", "B"}, pending=True)
    assert not asked.leave and not asked.release
    left = step({"a": HeldNode("A", (R,)), "b": HeldNode("B", (X,), draining=True)}, {"A", "B"}, pending=True)
    assert left.release == ("b",) and not left.lost  # it left at a commit: nothing lost


def test_a_finished_actor_is_not_replaced_and_an_ended_job_lets_everything_go() -> None:
    assert not step({"a": HeldNode("A", (X,))}, {"A"}, max_nodes=1).start
    over = step({"a": HeldNode("A", (R,)), "b": HeldNode("B", (R,))}, {"A", "B"}, ended=True)
    assert set(over.release) == {"a", "b"} and not over.ask_for_node and not over.start


# ---- bad input: one line that says what to do --------------------------------------------------
def run_cli(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"import sys\n{prelude}\nfrom elasticyolo.cli import main\nsys.exit(main({list(args)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_an_unreachable_ray_address_is_one_line() -> None:
    got = run_cli("ray", "status", "--job", "j", "--address", "127.0.0.1:1")
    assert got.returncode == 2 and got.stderr.count("\n") == 1, got.stderr
    assert "--address 127.0.0.1:1: no Ray cluster answers there" in got.stderr


def test_engine_ray_without_the_extra_is_one_line() -> None:
    got = run_cli("ray", "submit", "--job", "j", "data=x.yaml", prelude="sys.modules['ray'] = None")
    assert got.returncode == 2 and got.stderr.count("\n") == 1, got.stderr
    assert "engine ray is not installed here (pip install 'elasticyolo[ray]')" in got.stderr


def test_engine_ray_is_not_for_the_agents() -> None:
    from elasticyolo.engines import registry

    got = run_cli("submit", "--etcd", "127.0.0.1:1", "--job", "j", "data=x.yaml", "engine=ray")
    assert got.returncode == 2 and "`elasticyolo ray submit`" in got.stderr and got.stderr.count("\n") == 1
    with pytest.raises(UserError, match="runs on a Ray cluster"):  # an agent refuses it (status shows why)
        registry.get("ray").node(None)  # type: ignore[arg-type]
