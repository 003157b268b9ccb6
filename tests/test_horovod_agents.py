"""Horovod Elastic driven by elasticyolo agents: real etcd, real `elasticyolo agent`
processes (distinct node ids on 127.0.0.1), real Horovod workers training a real YOLO model on
generated data. Scenarios are schedules of kills/joins plus deadlines, never bare sleeps.

Default: SIGKILL of a non-leader agent mid-epoch (its worker dies too, world 3 -> 2), then a
4th agent joins (world grows back, newcomer gets the committed state). Slow: SIGKILL of one
worker only, and SIGKILL of the leader.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.trace import assert_each_epoch_exactly_once
from elasticyolo.processes import running
from elasticyolo.train.policy import nominal_accumulate, resize_ramp

N_TRAIN = 24
BATCH, NBS, RAMP = 4, 4, 2
# Loaded 2-core CI box: worker start-up (torch + Ultralytics import) can take ~30 s.
START_S, STEP_S = 240, 180


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=N_TRAIN, val=4, imgsz=64, classes=2))


def spec(data: Path, epochs: int) -> list[str]:
    # batch 4, nbs 4 -> accumulate 1: world 3 trains 12 images a step (2 steps an epoch); one commit
    # per step so the rollback point is exact; val off except where mAP is the point.
    return ["engine=horovod", "model=yolov8n.yaml", f"data={data}", f"epochs={epochs}", "imgsz=64", f"batch={BATCH}", f"nbs={NBS}",
            "warmup_epochs=0", "close_mosaic=0", "commit_every=1", "val=false", "policy=linear",
            f"resize_warmup_steps={RAMP}", "min_nodes=2", "gloo_timeout_s=5", "cooldown_s=1,4"]


def start_three(c: AgentCluster, data: Path, epochs: int) -> None:
    for n in ("a", "b", "c"):
        c.start(n)
    c.wait(lambda: c.ready(["a", "b", "c"]) and c.leader(), 30, "three agents and a leader")
    c.submit(*spec(data, epochs))
    c.wait(lambda: c.steps(world=3), START_S, "a step at world size 3")


def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if running(pid)]


def steps_after(events: list[dict], t: float, world: int) -> list[dict]:
    return [e for e in events if e["ev"] == "step" and e["t"] > t and e["world"] == world and e["rank"] == 0]


def assert_ramp(steps: list[dict], old: float, new: float) -> None:
    """Linear policy: after a resize the LR scale moves linearly from the old world's to the new
    world's over RAMP optimizer steps; accumulation stays at the reference world's."""
    scales = [s["lr_scale"] for s in steps[:RAMP + 1]]
    assert scales == pytest.approx([resize_ramp(old, new, i, RAMP) for i in range(len(scales))]), scales
    assert {s["accumulate"] for s in steps} <= {nominal_accumulate(NBS, BATCH, 1)}


def assert_exactly_once(events: list[dict], epochs: int) -> None:
    assert_each_epoch_exactly_once(events, epochs, N_TRAIN)


def test_agent_killed_world_shrinks_then_new_agent_grows_it(cluster: AgentCluster, dataset: Path) -> None:
    # Long enough for a 4th agent to start and pre-warm (imports, loader processes) on a busy
    # 2-core box while the world still trains.
    c, epochs = cluster, 30
    start_three(c, dataset, epochs)
    view = c.status()
    assert view["world_size"] == 3 and view["state"] == "running"
    assert sorted(n["id"] for n in view["nodes"] if n["state"] == "TRAINING") == ["a", "b", "c"]

    # 1. SIGKILL a non-leader agent mid-epoch: its worker dies with it, the world shrinks to 2.
    leader = c.leader()
    victim = next(n for n in ("c", "b", "a") if n != leader)
    # The world may have started at 2 and grown (a node pre-warming slowly on a loaded box): kill
    # once the LR ramp to world 3 is over, so the shrink ramps from 3.
    c.wait(lambda: [s for s in c.steps(world=3) if s["start"] > 0 and s["lr_scale"] == pytest.approx(3.0)], STEP_S,
           "a step in the middle of an epoch at world 3 after the LR ramp")
    children = c.kill(victim)
    t_kill = time.time()
    assert children, "the agent had no worker"
    c.wait(lambda: not alive(children), 5, f"{victim}'s workers to die with their agent (no orphans)")
    c.wait(lambda: steps_after(c.events(), t_kill, 2), STEP_S, "a step at world size 2")
    view = c.wait(lambda: (lambda v: v if v["world_size"] == 2 and victim not in [n["id"] for n in v["nodes"]]
                           else None)(c.status()), 10, "status to show world 2 without the victim")
    ev = c.events()
    resume2 = next(e for e in ev if e["ev"] == "resume" and e["world"] == 2 and e["t"] > t_kill)
    # Continued from the last commit made before the failure.
    commits = [e for e in ev if e["ev"] == "commit" and e["pid"] == resume2["pid"] and e["t"] < resume2["t"]]
    assert resume2["step"] == commits[-1]["step"]
    # Both survivors rolled back to the same commit: the reset moved no model or optimizer tensors.
    resumed = [e for e in ev if e["ev"] == "resume" and e["world"] == 2 and e["t"] > t_kill][:2]
    if len({e["step"] for e in resumed}) == 1:  # (a rank can lose the race to its last commit)
        assert max(e["params_digest"] for e in resumed) == pytest.approx(min(e["params_digest"] for e in resumed))
        assert any(str(r.get("event")).startswith("worker: state already identical") for n in c.agents
                   if n != victim for r in c.agents[n].log_records()), "identical survivors broadcast their state"
    c.wait(lambda: len(steps_after(c.events(), t_kill, 2)) > RAMP, STEP_S, "the LR ramp after the shrink")
    assert_ramp(steps_after(c.events(), resume2["t"] - 1e-6, 2), 3.0, 2.0)
    c.wait(lambda: c.progress().get("world_size") == 2, 30, "progress in etcd at world size 2")

    # 2. A 4th agent joins: the world grows at the next reset and the newcomer gets the state.
    t_join = time.time()
    c.start("d")
    c.wait(lambda: steps_after(c.events(), t_join, 3), START_S, "a step at world size 3 after the join")
    c.wait(lambda: {e["rank"] for e in c.events() if e["ev"] == "step" and e["world"] == 3 and e["t"] > t_join}
           == {0, 1, 2}, STEP_S, "every rank's first step at world size 3")
    ev = c.events()
    first3 = min(e["t"] for e in steps_after(ev, t_join, 3))
    # Each rank resumed before its own first step at world 3 (a step record is written before the
    # step's all-reduce, so a survivor's can precede the newcomer's resume, written after its sync).
    own_first3 = {r: min(e["t"] for e in ev if e["ev"] == "step" and e["world"] == 3 and e["rank"] == r
                         and e["t"] > t_join) for r in range(3)}
    resumes = [e for e in ev if e["ev"] == "resume" and e["world"] == 3 and t_join < e["t"] < own_first3[e["rank"]]]
    assert {e["rank"] for e in resumes} == {0, 1, 2}
    assert len({e["step"] for e in resumes}) == 1
    digests = [e["params_digest"] for e in resumes]
    assert max(digests) == pytest.approx(min(digests), rel=1e-9), "ranks hold different parameters after the sync"
    momenta = [e["optimizer_digest"] for e in resumes]
    assert max(momenta) == pytest.approx(min(momenta), rel=1e-9), "ranks hold different optimizer state after the sync"
    world = c.world()
    assert "d" in world["ranks"] and victim not in world["ranks"]

    c.wait(lambda: c.job_state() in ("done", "failed"), 600, "the job to finish")
    assert c.job_state() == "done"
    ev = c.events()
    assert_ramp(steps_after(ev, first3 - 1e-6, 3), 2.0, 3.0)
    assert_exactly_once(ev, epochs)
    view = c.status()
    assert view["state"] == "done" and view["epoch"] == epochs


@pytest.mark.slow
def test_worker_killed_world_reforms(cluster: AgentCluster, dataset: Path) -> None:
    # Enough epochs for a fresh warm worker (~30 s of imports on a busy 2-core box) to be ready
    # before the job ends: the world re-forms without the dead worker in under a second now.
    c, epochs = cluster, 40
    start_three(c, dataset, epochs)
    c.wait(lambda: len(c.steps(world=3)) >= 3, STEP_S, "steps at world size 3")
    pid = c.pid_of_rank(2)
    psutil.Process(pid).kill()
    t_kill = time.time()
    c.wait(lambda: steps_after(c.events(), t_kill, 2), STEP_S, "the world re-formed without the dead worker")
    # The slot comes back after the blacklist cooldown, with a fresh (pre-warmed) worker.
    c.wait(lambda: steps_after(c.events(), t_kill, 3), START_S, "the slot to rejoin (world 3 again)")
    assert all(a.proc is not None and a.proc.poll() is None for a in c.agents.values()), "an agent died"
    c.wait(lambda: c.job_state() in ("done", "failed"), 600, "the job to finish")
    assert c.job_state() == "done"
    assert_exactly_once(c.events(), epochs)


@pytest.mark.slow
def test_leader_killed_training_resumes_under_new_leader(cluster: AgentCluster, dataset: Path) -> None:
    c, epochs = cluster, 8
    start_three(c, dataset, epochs)
    leader = c.leader()
    assert leader is not None
    c.wait(lambda: [e for e in c.events() if e["ev"] == "commit" and e["step"] >= 3], STEP_S, "a few commits")
    # No wait here: the kill lands wherever training is.
    step_at_kill = max(e["step"] for e in c.events() if e["ev"] == "commit")
    c.kill(leader)
    t_kill = time.time()
    new_leader = c.wait(lambda: (lambda l: l if l not in (None, leader) else None)(c.leader()), 15, "a new leader")
    c.wait(lambda: steps_after(c.events(), t_kill, 2), START_S, "training to resume under the new leader")
    ev = c.events()
    first = min(steps_after(ev, t_kill, 2), key=lambda e: e["t"])
    resume = next(e for e in ev if e["ev"] == "resume" and e["t"] > t_kill and e["rank"] == 0)
    lost = step_at_kill - resume["step"]
    print(f"leader loss: new leader {new_leader}; first step after {first['t'] - t_kill:.1f}s; "
          f"resumed at step {resume['step']} (kill at {step_at_kill}: {lost} steps lost)")
    assert resume["step"] > 0, "restarted from scratch instead of the newest snapshot"
    c.wait(lambda: c.job_state() in ("done", "failed"), 600, "the job to finish")
    assert c.job_state() == "done"
    assert c.status()["leader"] == new_leader
