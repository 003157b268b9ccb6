"""Spot notice -> drain, end to end: real `elasticyolo agent` processes, real etcd, real
Horovod workers training YOLO on generated data, and the local metadata server (127.0.0.1)
speaking each cloud's API. Scenarios are schedules plus deadlines, never bare sleeps.

Lost steps are counted from the worker traces: the highest step any rank executed before the
world re-formed, minus the step the new world resumed at (0: nothing was rolled back).

Default run: AWS notice on a non-leader (graceful removal through Horovod's hosts-updated path).
Slow: the same for GCP and Azure, a notice on the leader (handover), a notice on the only node
(final checkpoint, then a cold restart resumes at that step).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.metadata_server import MetadataServer

N_TRAIN = 32
START_S, STEP_S = 240, 120
NOTICE_S = {"aws": 120.0, "gcp": 30.0, "azure": 30.0}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=N_TRAIN, val=4, imgsz=64, classes=2))


@pytest.fixture
def metadata() -> Iterator[MetadataServer]:
    with MetadataServer() as md:
        yield md


def spec(data: Path, epochs: int, min_nodes: int = 1, *extra: str) -> list[str]:
    return ["engine=horovod", "model=yolov8n.yaml", f"data={data}", f"epochs={epochs}", "imgsz=64", "batch=4", "nbs=4",
            "warmup_epochs=0", "close_mosaic=0", "commit_every=1", "val=false", f"min_nodes={min_nodes}",
            "gloo_timeout_s=5", "cooldown_s=1,4", *extra]


def spot_flags(provider: str, md: MetadataServer) -> list[str]:
    return ["--spot-provider", provider, "--metadata-url", md.url, "--spot-poll-interval", "0.5",
            "--drain-margin-s", "3"]


def events(c: AgentCluster, kind: str) -> list[dict[str, Any]]:
    out = []
    for _, v, _ in c.client.get_prefix(c.keys.events):
        ev = json.loads(v)
        if ev.get("kind") == kind:
            out.append(ev)
    return out


def first_resume_after(ev: list[dict], t: float, world: int) -> dict[str, Any] | None:
    return next((e for e in ev if e["ev"] == "resume" and e["t"] > t and e["world"] == world), None)


def lost_steps(ev: list[dict], resume: dict[str, Any]) -> int:
    """Highest step executed by any rank before the new world resumed, minus where it resumed."""
    before = [e["step"] for e in ev if e["ev"] == "step" and e["t"] < resume["t"]]
    return max(before, default=0) - resume["step"]


def start_agents(c: AgentCluster, first: list[str], others: dict[str, list[str]]) -> None:
    """Start `first` (the leader-to-be), wait for its leadership, then the others."""
    c.start(first[0], *first[1:])
    c.wait(lambda: c.leader() == first[0], 30, f"{first[0]} to lead")
    for node, flags in others.items():
        c.start(node, *flags)
    c.wait(lambda: c.ready([first[0], *others]), 30, "all agents registered")


def drain_non_leader(c: AgentCluster, md: MetadataServer, data: Path, provider: str) -> None:
    start_agents(c, ["a"], {"b": spot_flags(provider, md)})
    c.submit(*spec(data, epochs=8))
    c.wait(lambda: [s for s in c.steps(world=2) if s["start"] > 0], START_S, "a mid-epoch step at world size 2")

    t_notice = time.time()
    md.announce(provider, in_s=NOTICE_S[provider])
    # The node is DRAINING in etcd with the notice, then leaves; the world shrinks to 1.
    c.wait(lambda: events(c, "drain_start"), 15, "the drain to start")
    c.wait(lambda: c.agents["b"].proc.poll() is not None, 30, "the draining agent to leave")
    assert c.agents["b"].proc.returncode == 0
    c.wait(lambda: [s for s in c.steps(world=1) if s["t"] > t_notice], STEP_S, "training to continue at world 1")

    ev = c.events()
    resume = first_resume_after(ev, t_notice, 1)
    assert resume is not None
    commits = [e for e in ev if e["ev"] == "commit" and e["pid"] == resume["pid"] and e["t"] < resume["t"]]
    lost = lost_steps(ev, resume)
    assert resume["step"] == commits[-1]["step"], "the world rolled back instead of continuing from its commit"
    assert lost == 0, f"{lost} steps lost"

    end = c.wait(lambda: events(c, "drain_end"), 10, "the drain_end event")[0]
    notice = events(c, "notice")[0]
    assert notice["provider"] == provider and notice["drain"] is True
    assert end["mode"] == "leave" and end["lost_steps"] == 0, end
    assert end["notice_to_drained_s"] < 30, end
    print(f"{provider}: notice-to-drained {end['notice_to_drained_s']}s (worker left after "
          f"{end.get('worker_left_s')}s), lost steps {lost}, resumed at step {resume['step']}")

    # The job carries on with the remaining node; the driver did not count the exit as a failure.
    assert c.job_state() == "running"
    view = c.status()
    assert [n["id"] for n in view["nodes"]] == ["a"] and view["world_size"] == 1
    assert any(e["kind"] == "drain_end" for e in view["events"])
    assert "drained" in c.status(as_json=False)
    if provider == "azure":
        c.wait(lambda: md.acknowledged, 5, "the Azure Preempt event to be acknowledged")


def test_aws_notice_drains_non_leader_with_zero_lost_steps(cluster: AgentCluster, metadata: MetadataServer,
                                                           dataset: Path) -> None:
    drain_non_leader(cluster, metadata, dataset, "aws")


@pytest.mark.slow
@pytest.mark.parametrize("provider", ["gcp", "azure"])
def test_notice_drains_non_leader(cluster: AgentCluster, metadata: MetadataServer, dataset: Path,
                                  provider: str) -> None:
    drain_non_leader(cluster, metadata, dataset, provider)


@pytest.mark.slow
def test_notice_on_leader_hands_over_with_zero_lost_steps(cluster: AgentCluster, metadata: MetadataServer,
                                                          dataset: Path) -> None:
    c = cluster
    start_agents(c, ["a", *spot_flags("aws", metadata)], {"b": []})
    c.submit(*spec(dataset, epochs=8))
    c.wait(lambda: [s for s in c.steps(world=2) if s["start"] > 0], START_S, "a mid-epoch step at world size 2")
    t_notice = time.time()
    metadata.announce("aws", in_s=60)
    c.wait(lambda: c.leader() == "b", 30, "leadership to move to b")
    c.wait(lambda: c.agents["a"].proc.poll() is not None, 30, "the old leader to leave")
    c.wait(lambda: [s for s in c.steps(world=1) if s["t"] > t_notice], START_S, "training under the new leader")
    ev = c.events()
    quiesce = [e for e in ev if e["ev"] == "quiesce" and e["t"] > t_notice]
    assert quiesce, "the world did not quiesce before the handover"
    resume = first_resume_after(ev, quiesce[0]["t"], 1)
    assert resume is not None
    lost = lost_steps(ev, resume)
    assert resume["step"] == quiesce[0]["step"] and lost == 0, (resume, quiesce[0], lost)
    end = events(c, "drain_end")[0]
    assert end["mode"] == "handover" and end["committed_step"] == resume["step"], end
    assert end["notice_to_drained_s"] < 30
    print(f"leader handover: notice-to-drained {end['notice_to_drained_s']}s, resumed at step {resume['step']} "
          f"after {resume['t'] - t_notice:.1f}s, lost steps {lost}")
    assert c.job_state() == "running"


@pytest.mark.slow
def test_notice_on_only_node_checkpoints_then_cold_restart_resumes(cluster: AgentCluster, metadata: MetadataServer,
                                                                   dataset: Path, tmp_path: Path) -> None:
    c = cluster
    store = f"file://{tmp_path / 'ckpt'}"
    start_agents(c, ["a", *spot_flags("gcp", metadata)], {})
    c.submit(*spec(dataset, 6, 1, f"checkpoint={store}"))
    c.wait(lambda: len(c.steps(world=1)) >= 3, START_S, "a few steps on the only node")
    t_notice = time.time()
    metadata.announce("gcp")
    deadline = t_notice + NOTICE_S["gcp"]
    c.wait(lambda: c.agents["a"].proc.poll() is not None, 40, "the only node to drain and leave")
    ev = c.events()
    q = [e for e in ev if e["ev"] == "quiesce" and e["t"] > t_notice]
    assert q and q[0]["checkpoint"] is True, q
    assert q[0]["t"] < deadline, "the final checkpoint landed after the deadline"
    end = events(c, "drain_end")[0]
    assert end["last_node"] is True and end["checkpoint"] is True and end["notice_to_drained_s"] < 30, end
    step = q[0]["step"]

    # Cold restart: a fresh node (no local snapshot) resumes from the store at that step.
    t_restart = time.time()
    c.start("z")
    c.wait(lambda: first_resume_after(c.events(), t_restart, 1), START_S, "the restarted world to resume")
    resume = first_resume_after(c.events(), t_restart, 1)
    assert resume["step"] == step, (resume, step)
    print(f"only node: checkpoint at step {step} {deadline - q[0]['t']:.1f}s before the deadline; "
          f"notice-to-drained {end['notice_to_drained_s']}s; cold restart resumed at step {resume['step']}")
