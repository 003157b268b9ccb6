"""Failures seen before the lease expires: real etcd, real agents, real Horovod workers.

The agents run with a lease TTL of 10 s and the default heartbeat timeout (2 s), so every
recovery below that completes while the lost node's record is still in etcd was decided by the
fast signals (cluster/liveness.py), not by the lease. One scenario, one start-up:

1. only the agent of a node frozen (SIGSTOP; its worker, in its own session, trains on) for longer
   than the heartbeat timeout: its node is suspect, but the world still steps, so the node stays
   in it: the world keeps its size and every worker its process (a silent agent is no evidence
   that its worker stopped taking part: engines/horovod/failures.py);
2. thawed (SIGCONT), the agent is back and the world is unchanged;
3. process death: SIGKILL of another node's agent -> world 2 sooner than its lease could expire,
   and the leader revokes that lease at once;
4. a whole node frozen (SIGSTOP of its agent and every process under it; nothing is closed) ->
   the world goes on alone, again before the lease could tell;
and every finished epoch trained each sample exactly once.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.local_cluster.trace import coverage_by_epoch, pids_by_rank
from elasticyolo.processes import running

N_TRAIN = 24
TTL = 10  # the lease cannot be what detects a loss within these tests' deadlines
START_S, STEP_S = 240, 120
HEARTBEAT_TIMEOUT_S = 2.0  # the agents' default (config.py: heartbeat_timeout)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=N_TRAIN, val=4, imgsz=64, classes=2))


@pytest.fixture
def slow_lease_cluster(etcd_server: EtcdCluster, job_name: str, tmp_path: Path) -> Iterator[AgentCluster]:
    c = AgentCluster(etcd_server.endpoints, job_name, tmp_path, ttl=TTL,
                     env={"OMP_NUM_THREADS": "1", "ELASTICYOLO_SNAPSHOT_S": "2"})
    yield c
    c.stop()


def tree(pid: int) -> list[int]:
    try:
        root = psutil.Process(pid)
        return [pid] + [p.pid for p in root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass




# About a minute. A survivor must not sit out Gloo's 30 s timeout after an abort (a send queued on
# a shut connection is failed by the gloo that scripts/build_horovod.sh builds).
def test_failures_are_seen_before_the_lease(slow_lease_cluster: AgentCluster, dataset: Path) -> None:
    c = slow_lease_cluster
    for n in ("a", "b", "c"):
        c.start(n)
    c.wait(lambda: c.ready(["a", "b", "c"]) and c.leader(), 30, "three agents and a leader")
    c.submit("engine=horovod", "model=yolov8n.yaml", f"data={dataset}", "epochs=400", "imgsz=64", "batch=4", "nbs=4",
             "warmup_epochs=0", "close_mosaic=0", "commit_every=1", "val=false", "min_nodes=1",
             "gloo_timeout_s=30", "cooldown_s=1,2")
    c.wait(lambda: len(c.rank0_steps_after(0, 3)) >= 2, START_S, "steps at world size 3")
    leader = c.leader()
    x, y = [n for n in ("a", "b", "c") if n != leader]
    agent_x = c.agents[x].proc
    assert agent_x is not None

    # 1. Only x's agent freezes, for twice the heartbeat timeout: its worker keeps training, so the
    #    world keeps x; every worker is the process it was.
    workers = {c.worker_of(n) for n in (leader, x, y)}
    os.kill(agent_x.pid, signal.SIGSTOP)
    t1 = time.time()
    c.wait(lambda: time.time() - t1 > 2 * HEARTBEAT_TIMEOUT_S, 10, "the frozen agent to be suspect")  # the freeze must last
    t_suspect = time.time()
    c.wait(lambda: len(c.rank0_steps_after(t_suspect, 3)) >= 2, STEP_S, "world 3 stepping on while x's agent is silent")
    # Each rank traces a step before its all-reduce: the others' lines of rank 0's last step may
    # still be to come, so wait for every worker's line, then check they are the same processes.
    c.wait(lambda: {e["pid"] for e in c.steps() if e["t"] > t_suspect} >= workers, STEP_S,
           "every worker stepping while x's agent is silent")
    assert not c.steps(world=2), "the world dropped the node whose agent alone froze"
    assert {e["pid"] for e in c.steps() if e["t"] > t_suspect} == workers
    assert not [e for e in c.events() if e["ev"] == "resume" and e["t"] > t1], "the world re-formed"

    # 2. Thawed, the agent is back; the world and its workers are unchanged.
    os.kill(agent_x.pid, signal.SIGCONT)
    t2 = time.time()
    c.wait(lambda: len(c.rank0_steps_after(t2, 3)) >= 2, STEP_S, "the world stepping after the thaw")
    c.wait(lambda: {e["pid"] for e in c.steps() if e["t"] > t2} == workers, STEP_S, "every worker stepping")
    assert not [e for e in c.events() if e["ev"] == "resume" and e["t"] > t1], "the world re-formed"
    assert c.job_state() == "running"

    # 3. Process death: SIGKILL of y's agent (its worker dies with it). World 2 before y's lease
    #    could have ended; the leader revoked that lease at once (agent/dead_nodes.py).
    t3 = time.time()
    c.kill(y)
    c.wait(lambda: c.rank0_steps_after(t3, 2), STEP_S, "world 2 after the agent's death")
    assert c.rank0_steps_after(t3, 2)[0]["t"] - t3 < TTL, "the lease expired first: the closed connection did not decide"
    c.wait(lambda: y not in c.nodes(), 5, "the dead agent's lease revoked by the leader")

    # 4. x's whole node freezes (agent, worker, loader processes: no socket closes). The leader's
    #    worker goes on alone before x's lease ends, without waiting out Gloo's 30 s timeout.
    frozen = tree(agent_x.pid)
    for p in frozen:
        _signal(p, signal.SIGSTOP)
    t4 = time.time()
    try:
        c.wait(lambda: c.rank0_steps_after(t4, 1), STEP_S, "world 1 after the whole node froze")
        assert x in c.nodes(), "the lease expired first: the heartbeat timeout did not decide"
        assert time.time() - t4 < 30, "the world waited out Gloo's timeout"
    finally:
        for p in frozen:
            _signal(p, signal.SIGKILL)
    assert c.job_state() == "running"

    # Every finished epoch trained each sample exactly once through all of that.
    cov = coverage_by_epoch(c.events())
    done = [e for e in sorted(cov) if e < max(cov)]
    assert done, "no epoch finished"
    for epoch in done:
        assert sorted(cov[epoch]) == list(range(N_TRAIN)), f"epoch {epoch}: duplicates or gaps"
