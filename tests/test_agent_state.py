"""The state machine step by step (pure: no etcd) and the agent config's precedence and errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from elasticyolo.agent.state import NodeState as S
from elasticyolo.agent.state import Observation, decide, reregisters_in_place
from elasticyolo.config import load_agent_config
from elasticyolo.errors import UserError

REPO = Path(__file__).resolve().parents[1]


def step(state: S, **obs: object) -> S:
    t = decide(state, Observation(**obs))  # type: ignore[arg-type]
    return state if t is None else t.new


def test_happy_path() -> None:
    s = S.JOINING
    s = step(s)  # not registered yet: stay
    assert s is S.JOINING
    s = step(s, registered=True)
    assert s is S.IDLE
    assert step(s, registered=True) is S.IDLE  # no job: idle
    s = step(s, registered=True, job_active=True)
    assert s is S.TRAINING
    assert step(s, registered=True, job_active=True) is S.TRAINING
    assert step(s, registered=True, job_active=False) is S.IDLE  # cancelled
    s = step(s, registered=True, job_active=True, drain_requested=True)
    assert s is S.DRAINING
    assert step(s, drain_complete=False) is S.DRAINING
    s = step(s, drain_complete=True)
    assert s is S.LEFT
    assert decide(s, Observation(registered=True, job_active=True)) is None  # terminal


def test_drain_from_every_live_state_and_lease_loss() -> None:
    for s in (S.JOINING, S.IDLE, S.TRAINING):
        assert step(s, registered=True, drain_requested=True) is S.DRAINING
    # a lapsed lease is no departure: the member keeps its state and re-registers in place
    for s in (S.IDLE, S.TRAINING):
        obs = Observation(registered=False, lease_lost=True, job_active=s is S.TRAINING)
        assert decide(s, obs) is None and reregisters_in_place(s, obs)
        assert not reregisters_in_place(s, Observation(registered=True, job_active=s is S.TRAINING))
    assert not reregisters_in_place(S.JOINING, Observation(lease_lost=True))
    assert not reregisters_in_place(S.DRAINING, Observation(lease_lost=True))
    # a drain that is already under way is not interrupted by a lost lease
    assert step(S.DRAINING, lease_lost=True) is S.DRAINING


def test_fatal_and_reasons() -> None:
    t = decide(S.JOINING, Observation(fatal="node id taken"))
    assert t is not None and t.new is S.FAILED and t.reason == "node id taken"
    assert decide(S.FAILED, Observation(registered=True)) is None
    t = decide(S.IDLE, Observation(registered=True, job_active=True))
    assert t is not None and (t.old, t.new, t.reason) == (S.IDLE, S.TRAINING, "job active")


# ---- config ---------------------------------------------------------------------------------
def test_config_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text("etcd: [127.0.0.1:1]\njob: fromfile\nttl: 7\nslots: 3\nzone: z-file\n")
    env = {"ELASTICYOLO_TTL": "9", "ELASTICYOLO_ZONE": "z-env", "ELASTICYOLO_LOG_FORMAT": "json"}
    cfg = load_agent_config(str(f), {"ttl": 11, "slots": None}, env)
    assert (cfg.job, cfg.ttl, cfg.slots, cfg.zone) == ("fromfile", 11, 3, "z-env")
    assert cfg.etcd == ["127.0.0.1:1"] and cfg.metrics_addr == "127.0.0.1"


def test_config_env_only_and_defaults(tmp_path: Path) -> None:
    cfg = load_agent_config(None, {}, {"ELASTICYOLO_CONFIG": "", "ELASTICYOLO_ETCD": "127.0.0.1:1,127.0.0.1:2",
                                       "ELASTICYOLO_PREEMPTIBLE": "false"})
    assert cfg.etcd == ["127.0.0.1:1", "127.0.0.1:2"] and cfg.preemptible is False and cfg.ttl == 5


@pytest.mark.parametrize("text, env, flags, needle", [
    ("etcd: [127.0.0.1:1]\nttl: 0\n", {}, {}, "ttl: Input should be greater than or equal to 1 (from config file"),
    ("etcd: [127.0.0.1:1]\nbogus: 1\n", {}, {}, "bogus: unknown setting"),
    ("etcd: [127.0.0.1:1]\n", {"ELASTICYOLO_SLOTS": "many"}, {}, "slots: Input should be a valid integer"),
    ("etcd: [127.0.0.1:1]\n", {}, {"job": "Bad/Name"}, "job: job name 'Bad/Name' is invalid"),
    ("etcd: [127.0.0.1:1]\n", {}, {"node_id": "a/b"}, "node id 'a/b' is invalid"),
    ("etcd: [127.0.0.1:notaport]\n", {}, {}, "port 'notaport' is not a number"),
    ("etcd: [127.0.0.1:1]\n  - broken: [\n", {}, {}, "line"),
    ("- just\n- a list\n", {}, {}, "expected a mapping"),
    ("etcd: [127.0.0.1:1]\nspec:\n  data: d.yaml\n  epochs: 0\n", {}, {}, "spec: epochs: Input should be greater"),
    ("etcd: [127.0.0.1:1]\nspec:\n  model: yolov8n.pt\n  data: d.yaml\n", {}, {}, "needs a weights download"),
    ("etcd: [127.0.0.1:1]\netcd_ca: /no/such/ca.pem\n", {}, {}, "etcd_ca: /no/such/ca.pem: no such file"),
    ("job: x\n", {}, {}, "no etcd endpoints"),
])
def test_config_errors_are_one_line(tmp_path: Path, text: str, env: dict[str, str], flags: dict[str, object],
                                    needle: str) -> None:
    f = tmp_path / "agent.yaml"
    f.write_text(text)
    with pytest.raises(UserError) as err:
        load_agent_config(str(f), flags, env)
    msg = str(err.value)
    assert "\n" not in msg
    assert needle in msg, msg


def test_missing_explicit_config_file() -> None:
    with pytest.raises(UserError, match="config file /no/such.yaml: not found"):
        load_agent_config("/no/such.yaml", {"etcd": "127.0.0.1:1"}, {})


def test_example_config_is_valid() -> None:
    cfg = load_agent_config(str(REPO / "deploy" / "agent.yaml"), {}, {})
    assert len(cfg.etcd) == 3 and cfg.job == "coco-yolov8n" and cfg.metrics_addr == "127.0.0.1"
