"""The job's lifecycle: the transition rule stepped state by state (pure), then its one writer on a
real etcd (the record stays the JSON it always was; fences and a lost race write nothing)."""

from __future__ import annotations

import itertools
import json

import pytest

from elasticyolo.cluster.etcd import EtcdClient, b64
from elasticyolo.cluster.job_state import (ACTIVE_STATES, ENDED_STATES, JobEvent, JobState, Refused,
                                           next_job_state)
from elasticyolo.cluster.jobs import read_job_state, set_job_state, submit_spec
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.spec import TrainSpec
from elasticyolo.local_cluster.servers import EtcdCluster

S, R, D, F, C = JobState.SUBMITTED, JobState.RUNNING, JobState.DONE, JobState.FAILED, JobState.CANCELLED
E = JobEvent
UNREADABLE = None

# Every transition the code makes: (state before, event, state after).
LEGAL = {
    (S, E.START, R),  # rank 0's first (re)start record; the Horovod driver starting the workers
    (S, E.FINISH, D), (R, E.FINISH, D),  # the torch/plug-in worker or the Horovod driver saw the last epoch
    (S, E.FAIL, F), (R, E.FAIL, F),  # the Horovod driver; the leader's crash-loop watch
    *((s, E.SUBMIT, S) for s in (*JobState, UNREADABLE)),  # submit, and submit --replace over anything
    *((s, E.CANCEL, C) for s in (*JobState, UNREADABLE)),  # cancel (and cancel --purge of an ended job)
}


@pytest.mark.parametrize("current,event,after", sorted(LEGAL, key=str))
def test_each_legal_transition(current: JobState | None, event: JobEvent, after: JobState) -> None:
    assert next_job_state(current, event) is after


def test_every_other_pair_is_refused_with_a_reason() -> None:
    legal = {(s, e) for s, e, _ in LEGAL}
    refused = [(s, e) for s, e in itertools.product((*JobState, UNREADABLE), JobEvent) if (s, e) not in legal]
    assert refused, "the rule refuses something"
    for current, event in refused:
        got = next_job_state(current, event)
        assert isinstance(got, Refused) and got.current is current and got.event is event and got.reason, got
    # The refusals that matter: an ended job never runs, finishes or fails again without a new
    # submission, and a running job is not started twice.
    assert next_job_state(R, E.START).reason == "the job is already running"  # type: ignore[union-attr]
    assert next_job_state(C, E.FINISH).reason == "a cancelled job cannot finish"  # type: ignore[union-attr]
    for ended, event in itertools.product(ENDED_STATES, (E.START, E.FINISH, E.FAIL)):
        assert isinstance(next_job_state(ended, event), Refused)


def test_a_job_from_submission_to_its_end() -> None:
    state: JobState | None = UNREADABLE
    for event, expected in ((E.SUBMIT, S), (E.START, R), (E.FINISH, D), (E.SUBMIT, S), (E.FAIL, F),
                            (E.SUBMIT, S), (E.START, R), (E.CANCEL, C)):
        got = next_job_state(state, event)
        assert got is expected, (state, event, got)
        state = got


def test_states_are_the_strings_records_hold() -> None:
    assert [s.value for s in JobState] == ["submitted", "running", "done", "failed", "cancelled"]
    assert ACTIVE_STATES == {S, R} and ENDED_STATES == {D, F, C}
    # A state read from a record is a plain string: it compares, hashes and prints as the enum.
    assert "running" in ACTIVE_STATES and "done" in ENDED_STATES and "done" not in ACTIVE_STATES
    assert JobState.parse("failed") is F and JobState.parse("paused") is None and JobState.parse(None) is None
    assert f"{D}" == str(D) == "done" and json.dumps({"state": D}) == '{"state": "done"}'


def test_the_writer_applies_the_rule_under_its_fences(etcd_server: EtcdCluster, job_name: str) -> None:
    client, keys = EtcdClient(etcd_server.endpoints), JobKeys(job_name)
    record = lambda: json.loads(client.get(keys.state)[0])  # noqa: E731
    # A record written before the enum existed reads as the same state.
    client.put(keys.state, json.dumps({"state": "running", "at": 1.0}))
    assert read_job_state(client, keys)[0] is R
    client.delete(keys.state)

    assert submit_spec(client, keys, TrainSpec.from_pairs(["data=d.yaml"]), by="tester")
    generation = client.get(keys.spec)[1]
    assert record()["state"] == "submitted" and record()["by"] == "tester"
    assert not set_job_state(client, keys, E.START, generation=generation - 1, by="stale rank 0")  # another submission
    assert set_job_state(client, keys, E.START, generation=generation, by="rank 0")
    assert record()["state"] == "running"
    assert not set_job_state(client, keys, E.START, generation=generation, by="the driver")  # refused: running
    assert record()["by"] == "rank 0"

    client.put(keys.leader, json.dumps({"node_id": "a"}))
    term = client.get(keys.leader)[1]
    fence = {"key": b64(keys.leader), "result": "EQUAL", "target": "MOD", "mod_revision": str(term)}
    client.put(keys.leader, json.dumps({"node_id": "b"}))  # a new term: the old leader is deposed
    assert not set_job_state(client, keys, E.FAIL, by="old leader", reason="crash loop", fence=[fence])
    assert record()["state"] == "running"

    assert set_job_state(client, keys, E.CANCEL, by="operator", reason="cancelled by operator")
    assert record()["state"] == "cancelled" and record()["reason"] == "cancelled by operator"
    assert not set_job_state(client, keys, E.FINISH, generation=generation, by="late worker")  # refused: ended
    assert record()["state"] == "cancelled"

    assert submit_spec(client, keys, TrainSpec.from_pairs(["data=d.yaml"]), by="tester", replace=True)
    assert set_job_state(client, keys, E.FINISH, generation=client.get(keys.spec)[1], by="worker")
    assert record()["state"] == "done" and "reason" not in record()
