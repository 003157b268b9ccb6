"""Churn never ends a job: real etcd, real agents at a 2 s lease, real Horovod workers, real YOLO.

1. a node's agent frozen (SIGSTOP) for 1.5 TTL while its worker trains, beside a CPU hog: its
   lease lapses, it re-registers in place, and its worker, the world and the job go on; no host
   is blacklisted;
2. the leader's agent frozen for 1.5 TTL: its lease (and leadership) lapses, the world keeps
   training (re-formed from the workers' in-memory snapshots at most once per leadership change),
   and the job goes on;
3. a deterministic worker error (a data path missing on the nodes) fails the job, with the reason
   in `status --json`, instead of restarting forever.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.local_cluster.trace import coverage_by_epoch

N_TRAIN = 24
TTL = 2
START_S, STEP_S = 240, 120


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=N_TRAIN, val=4, imgsz=64, classes=2))


@pytest.fixture
def cluster(etcd_server: EtcdCluster, job_name: str, tmp_path: Path) -> Iterator[AgentCluster]:
    c = AgentCluster(etcd_server.endpoints, job_name, tmp_path, ttl=TTL,
                     env={"OMP_NUM_THREADS": "1", "ELASTICYOLO_SNAPSHOT_S": "2"})
    yield c
    c.stop()


@pytest.fixture
def cpu_hog() -> Iterator[None]:
    """Both cores busy beside the cluster, as data loaders keep a training node's CPUs."""
    hog = subprocess.Popen(["stress-ng", "--cpu", "2", "--quiet"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    yield
    hog.terminate()
    hog.wait(10)


def freeze(c: AgentCluster, node: str, seconds: float) -> None:
    """SIGSTOP `node`'s agent (only the agent: its worker runs in a session of its own) for
    `seconds`, then SIGCONT."""
    proc = c.agents[node].proc
    assert proc is not None
    os.kill(proc.pid, signal.SIGSTOP)
    t = time.time()
    try:
        c.wait(lambda: time.time() - t >= seconds, seconds + 5, f"{node}'s agent frozen for {seconds:g}s")  # the freeze must last
    finally:
        os.kill(proc.pid, signal.SIGCONT)


def lapses(c: AgentCluster, node: str) -> int:
    return sum(1 for r in c.logs(node) if r.get("event") == "lease lapsed; re-registering in place")


def blacklisted(c: AgentCluster) -> list[dict]:
    return [r for n in c.agents for r in c.logs(n) if "blacklist" in str(r.get("event", "")).lower()
            and r.get("blacklist")]


def start(c: AgentCluster, dataset: Path, *extra: str) -> None:
    for n in ("a", "b", "c"):
        c.start(n)
    c.wait(lambda: c.ready(["a", "b", "c"]) and c.leader(), 30, "three agents and a leader")
    c.submit("engine=horovod", "model=yolov8n.yaml", f"data={dataset}", "epochs=400", "imgsz=64", "batch=4", "nbs=4",
             "warmup_epochs=0", "close_mosaic=0", "commit_every=1", "val=false", "min_nodes=1",
             "gloo_timeout_s=10", "cooldown_s=1,4", *extra)


def test_lease_lapses_cost_no_worker_and_no_job(cluster: AgentCluster, dataset: Path, cpu_hog: None) -> None:
    c = cluster
    start(c, dataset)
    c.wait(lambda: len(c.rank0_steps_after(0, 3)) >= 2, START_S, "steps at world size 3")

    # 1. A member's agent frozen past its lease: it re-registers in place; its worker trains on.
    leader = c.leader()
    x = next(n for n in ("a", "b", "c") if n != leader)
    worker_x = c.worker_of(x)
    freeze(c, x, 1.5 * TTL)
    t1 = time.time()
    c.wait(lambda: lapses(c, x) >= 1, 30, f"{x}'s agent to see its lease lapsed")
    c.wait(lambda: x in c.nodes() and c.nodes()[x].get("state") == "TRAINING", 30, f"{x} registered again")
    t_back = time.time()
    c.wait(lambda: len(c.rank0_steps_after(t_back, 3)) >= 2, STEP_S, "world 3 stepping after the lapse")
    assert c.worker_of(x) == worker_x, "the node's worker was replaced after its agent's lease lapsed"
    assert worker_x in {e["pid"] for e in c.steps() if e["t"] > t1}
    assert c.job_state() == "running"

    # 2. The leader's agent frozen past its lease: leadership moves or is re-taken; the world keeps
    #    training (one re-form from the workers' in-memory snapshots) and the job goes on.
    leader = c.leader()
    assert leader is not None
    t2 = time.time()
    freeze(c, leader, 1.5 * TTL)
    c.wait(lambda: lapses(c, leader) >= 1, 30, "the old leader to see its lease lapsed")
    t_thawed = time.time()
    c.wait(lambda: len(c.rank0_steps_after(t_thawed, 3)) >= 2, START_S, "world 3 stepping after the leader's lapse")
    assert c.job_state() == "running"
    assert not blacklisted(c), "a healthy host was blacklisted"

    # Exactly once through both: every finished epoch trained each sample once.
    cov = coverage_by_epoch([e for e in c.events() if e["t"] > 0])
    done = [e for e in sorted(cov) if e < max(cov)]
    for epoch in done:
        assert sorted(cov[epoch]) == list(range(N_TRAIN)), f"epoch {epoch}: duplicates or gaps"
    resumes_after_leader = sorted({round(e["t"]) for e in c.events() if e["ev"] == "resume" and e["t"] > t2})
    print(f"re-forms after the leader's lapse (resume seconds): {resumes_after_leader}")


def test_a_deterministic_worker_error_fails_the_job_with_its_reason(cluster: AgentCluster, tmp_path: Path) -> None:
    c = cluster
    missing = tmp_path / "not-on-the-nodes" / "data.yaml"
    for n in ("a", "b"):
        c.start(n)
    c.wait(lambda: c.ready(["a", "b"]) and c.leader(), 30, "two agents and a leader")
    c.submit("engine=horovod", "model=yolov8n.yaml", f"data={missing}", "epochs=2", "imgsz=64", "batch=4", "val=false",
             "min_nodes=1", "gloo_timeout_s=10", "cooldown_s=1,4")
    c.wait(lambda: c.job_state() == "failed", START_S, "the job to fail")
    status = c.status()
    assert status["state"] == "failed", status
    reason = str(status.get("reason") or c.job_record().get("reason") or "")
    assert "crashed" in reason, status
    assert not blacklisted(c), "a host was blacklisted for an error every host has"
