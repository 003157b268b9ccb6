"""The drain as pure decisions (`engines/drain.py`): `decide` stepped through every path, the
executor driven by a fake node and fake effects (no processes, no etcd), and Horovod's planner."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from elasticyolo.cluster.keys import JobKeys
from elasticyolo.engines.base import STOP, DrainMode, DrainPlan, DrainSituation, Quiesce
from elasticyolo.engines.drain import (KILL_LEAD_S, RESUME_WAIT_S, Act, DrainExecutor, DrainObservation,
                                       DrainProgress, decide, kill_lead_s)
from elasticyolo.engines.horovod.drain import plan_drain

LEAVE = DrainPlan(DrainMode.LEAVE)
HANDOVER_LEADER = DrainPlan(DrainMode.HANDOVER, quiesce=Quiesce(checkpoint=False, hold=True, term=7))
HANDOVER_LAST = DrainPlan(DrainMode.HANDOVER, last_node=True, quiesce=Quiesce(checkpoint=True, hold=False, term=None))
DEADLINE = 100.0


def obs(now: float = 0.0, workers: int = 1, ack: dict | None = None, resume: dict | None = None) -> DrainObservation:
    return DrainObservation(now=now, deadline=DEADLINE, workers_running=workers, ack=ack, resume=resume)


# ---- decide ---------------------------------------------------------------------------------
def test_stop_plan_stops_workers_until_none_run() -> None:
    done = DrainProgress()
    assert decide(STOP, done, obs(workers=2)) is Act.STOP_WORKERS
    assert decide(STOP, done, obs(workers=0)) is Act.FINISH


def test_leave_waits_for_the_world_to_let_the_worker_go_then_for_lost_steps() -> None:
    done = DrainProgress()
    assert decide(LEAVE, done, obs(now=10)) is Act.WAIT  # the world removes the node at a commit
    assert decide(LEAVE, done, obs(now=11, workers=0)) is Act.NOTE_WORKER_GONE
    done.worker_gone_at = 11
    assert decide(LEAVE, done, obs(now=12, workers=0)) is Act.WAIT  # survivors' resume record not yet there
    assert decide(LEAVE, done, obs(now=12.5, workers=0, resume={"lost_steps": 0})) is Act.RECORD_RESUME
    done.resume_known = True
    assert decide(LEAVE, done, obs(now=13, workers=0)) is Act.FINISH


def test_leave_kills_the_worker_at_the_deadline_and_gives_up_on_lost_steps() -> None:
    done = DrainProgress()
    assert decide(LEAVE, done, obs(now=DEADLINE - KILL_LEAD_S - 0.1)) is Act.WAIT
    assert decide(LEAVE, done, obs(now=DEADLINE - KILL_LEAD_S)) is Act.KILL_AT_DEADLINE
    done.killed = True
    assert decide(LEAVE, done, obs(now=DEADLINE - 1)) is Act.STOP_WORKERS  # keeps escalating
    assert decide(LEAVE, done, obs(now=DEADLINE - 0.5, workers=0)) is Act.NOTE_WORKER_GONE
    done.worker_gone_at = DEADLINE - 0.5
    assert decide(LEAVE, done, obs(now=DEADLINE, workers=0)) is Act.RESUME_UNKNOWN  # deadline
    other = DrainProgress(worker_gone_at=10)
    assert decide(LEAVE, other, obs(now=10 + RESUME_WAIT_S + 0.1, workers=0)) is Act.RESUME_UNKNOWN


def test_a_short_drain_window_still_gives_the_world_most_of_it_to_let_the_worker_go() -> None:
    # A 2 s notice less a 0.5 s margin (a replay compressed 60x): the full lead would kill at once.
    assert kill_lead_s(1.5) == pytest.approx(0.375) and kill_lead_s(115.0) == KILL_LEAD_S
    lead = kill_lead_s(1.5)
    short = lambda now: DrainObservation(now=now, deadline=DEADLINE, workers_running=1, kill_lead_s=lead)  # noqa: E731
    done = DrainProgress()
    assert decide(LEAVE, done, short(DEADLINE - 1.5)) is Act.WAIT
    assert decide(LEAVE, done, short(DEADLINE - lead - 0.01)) is Act.WAIT
    assert decide(LEAVE, done, short(DEADLINE - lead)) is Act.KILL_AT_DEADLINE


def test_handover_quiesces_releases_then_stops() -> None:
    done = DrainProgress()
    assert decide(HANDOVER_LEADER, done, obs()) is Act.WRITE_REQUEST
    done.request_written = True
    assert decide(HANDOVER_LEADER, done, obs(now=1)) is Act.WAIT
    assert decide(HANDOVER_LEADER, done, obs(now=2, ack={"id": "x", "step": 40})) is Act.ACCEPT_ACK
    done.acked = True
    assert decide(HANDOVER_LEADER, done, obs(now=2)) is Act.RELEASE
    done.released = True
    assert decide(HANDOVER_LEADER, done, obs(now=2)) is Act.STOP_WORKERS  # no waiting for the world
    assert decide(HANDOVER_LEADER, done, obs(now=3, workers=0)) is Act.NOTE_WORKER_GONE
    done.worker_gone_at = 3
    assert decide(HANDOVER_LEADER, done, obs(now=3, workers=0)) is Act.FINISH  # lost steps known from the ack


def test_handover_without_an_ack_goes_on_at_the_deadline() -> None:
    done = DrainProgress(request_written=True)
    assert decide(HANDOVER_LAST, done, obs(now=DEADLINE - KILL_LEAD_S - 0.1)) is Act.WAIT
    assert decide(HANDOVER_LAST, done, obs(now=DEADLINE - KILL_LEAD_S)) is Act.ACK_TIMEOUT


# ---- the executor, stepped with fakes ---------------------------------------------------------
class FakeClient:
    def __init__(self) -> None:
        self.kv: dict[str, dict[str, Any]] = {}
        self.fail_puts = 0

    def put(self, key: str, value: str, lease: int | None = None) -> int:
        import json

        from elasticyolo.errors import UnavailableError

        if self.fail_puts:
            self.fail_puts -= 1
            raise UnavailableError("etcd unreachable (test)")
        self.kv[key] = json.loads(value)
        return 1

    def get_json(self, key: str) -> dict[str, Any] | None:
        return self.kv.get(key)

    def delete(self, key: str) -> bool:
        return self.kv.pop(key, None) is not None


@dataclass
class FakeDrain:
    reason: str | None = "test"
    started_at: float | None = field(default_factory=time.time)
    deadline: float = field(default_factory=lambda: time.monotonic() + 60)
    report: dict[str, Any] = field(default_factory=dict)


class FakeCfg:
    node_id = "n1"


class FakeNode:
    def __init__(self) -> None:
        self.cfg, self.keys, self.client, self.drain = FakeCfg(), JobKeys("j"), FakeClient(), FakeDrain()
        self.record: dict[str, Any] = {}
        self.resigned: list[str] = []

    def set_record_field(self, name: str, value: Any) -> None:
        self.record[name] = value

    def resign(self, reason: str) -> None:
        self.resigned.append(reason)


class FakeEffects:
    def __init__(self, workers: int = 1) -> None:
        self.workers, self.stops, self.released = workers, 0, []

    def running_workers(self) -> int:
        return self.workers

    def stop_workers(self, reason: str) -> None:
        self.stops += 1

    def release(self, reason: str) -> None:
        self.released.append(reason)


def test_executor_runs_a_leader_handover() -> None:
    node, fx = FakeNode(), FakeEffects()
    ex = DrainExecutor(node, HANDOVER_LEADER, fx)  # type: ignore[arg-type]
    node.client.fail_puts = 1  # the first write of the request fails: retried next iteration
    ex.start()
    assert node.record == {"drain_mode": "handover"} and node.drain.report["mode"] == "handover"
    assert node.keys.quiesce not in node.client.kv
    assert ex.step() is False
    req = node.client.kv[node.keys.quiesce]
    assert (req["term"], req["hold"], req["checkpoint"], req["by"]) == (7, True, False, "n1")
    assert ex.step() is False and fx.stops == 0  # waiting for the world to quiesce
    node.client.kv[node.keys.quiesce_ack] = {"id": "someone-else", "step": 3}
    assert ex.step() is False and fx.stops == 0  # not our request
    node.client.kv[node.keys.quiesce_ack] = {"id": req["id"], "step": 41, "checkpoint": None}
    assert ex.step() is False  # ack -> release -> stop workers, in one iteration
    assert fx.released == ["handover after the drain snapshot"] and node.resigned and fx.stops == 1
    assert node.keys.quiesce not in node.client.kv and node.record["drain_mode"] == "leave"
    assert node.drain.report["committed_step"] == 41 and node.drain.report["lost_steps"] == 0
    fx.workers = 0
    assert ex.step() is True
    assert ex.acts[-1] is Act.FINISH and "worker_left_s" in node.drain.report


def test_executor_runs_a_leave_and_records_lost_steps() -> None:
    node, fx = FakeNode(), FakeEffects()
    ex = DrainExecutor(node, LEAVE, fx)  # type: ignore[arg-type]
    ex.start()
    assert node.record == {"drain_mode": "leave"}
    assert ex.step() is False and fx.stops == 0  # the worker is left to the world
    fx.workers = 0
    node.client.kv[node.keys.resume] = {"at": 0.0, "lost_steps": 9}  # an older resume: ignored
    assert ex.step() is False
    node.client.kv[node.keys.resume] = {"at": time.time(), "lost_steps": 0, "step": 12, "world": 2}
    assert ex.step() is True
    assert (node.drain.report["lost_steps"], node.drain.report["world_after"]) == (0, 2)


def test_executor_stop_plan() -> None:
    node, fx = FakeNode(), FakeEffects(workers=2)
    ex = DrainExecutor(node, STOP, fx)  # type: ignore[arg-type]
    ex.start()
    assert node.record == {} and node.drain.report["mode"] == "stop"
    assert ex.step() is False and ex.step() is False and fx.stops == 2  # escalation is the effect's
    fx.workers = 0
    assert ex.step() is True and fx.released == ["drained"]


# ---- Horovod's planner -------------------------------------------------------------------------
@pytest.mark.parametrize("situation, expected", [
    (DrainSituation(has_work=False), STOP),
    (DrainSituation(has_work=True, other_slots=2, needed_slots=1), LEAVE),
    (DrainSituation(has_work=True, runs_coordinator=True, coordinator_term=7, other_slots=2, needed_slots=1),
     HANDOVER_LEADER),
    (DrainSituation(has_work=True, other_slots=0, needed_slots=1), HANDOVER_LAST),
    (DrainSituation(has_work=True, runs_coordinator=True, coordinator_term=3, other_slots=1, needed_slots=2),
     DrainPlan(DrainMode.HANDOVER, last_node=True, quiesce=Quiesce(checkpoint=True, hold=True, term=3))),
])
def test_horovod_plan(situation: DrainSituation, expected: DrainPlan) -> None:
    assert plan_drain(situation) == expected
    assert plan_drain(situation).holds_leadership == bool(expected.quiesce and expected.quiesce.hold)


# ---- the torch engine's planner ----------------------------------------------------------------
STOP_THEN_READ = DrainPlan(DrainMode.STOP, survivors_report=True)


def test_a_stop_whose_survivors_report_waits_for_their_lost_steps() -> None:
    """The torch engine: the stopped worker leaves at its next commit, the others train on and
    say what they lost in their resume record."""
    done = DrainProgress()
    assert decide(STOP_THEN_READ, done, obs(now=10)) is Act.STOP_WORKERS
    assert decide(STOP_THEN_READ, done, obs(now=11, workers=0)) is Act.NOTE_WORKER_GONE
    done.worker_gone_at = 11
    assert decide(STOP_THEN_READ, done, obs(now=12, workers=0)) is Act.WAIT
    assert decide(STOP_THEN_READ, done, obs(now=12.5, workers=0, resume={"lost_steps": 0})) is Act.RECORD_RESUME
    done.resume_known = True
    assert decide(STOP_THEN_READ, done, obs(now=13, workers=0)) is Act.FINISH
    late = DrainProgress(worker_gone_at=10)
    assert decide(STOP_THEN_READ, late, obs(now=10 + RESUME_WAIT_S + 0.1, workers=0)) is Act.RESUME_UNKNOWN


@pytest.mark.parametrize("situation, expected", [
    (DrainSituation(has_work=True, other_slots=2, needed_slots=1), STOP_THEN_READ),
    (DrainSituation(has_work=True, runs_coordinator=True, other_slots=1, needed_slots=1), STOP_THEN_READ),
    (DrainSituation(has_work=True, other_slots=0, needed_slots=1), DrainPlan(DrainMode.STOP, last_node=True)),
    (DrainSituation(has_work=True, other_slots=1, needed_slots=2), DrainPlan(DrainMode.STOP, last_node=True)),
])
def test_torch_plan(situation: DrainSituation, expected: DrainPlan) -> None:
    from elasticyolo.engines.torch.engine import ENGINE

    assert ENGINE.plan_drain(situation) == expected
