"""Network partitions and their healing: real etcd, real agents, real Horovod workers,
every node in a network namespace of its own (`tests/support/netns.py`: veths to a bridge in
a hub namespace, nothing in the root namespace, no default route). A cut sets a node's link down.

One start-up, three nodes at world 3 (lease TTL 4 s, heartbeat timeout 2 s):

1. a non-leader is cut off mid-epoch: the other two train on at world 2 after about the heartbeat
   timeout, and neither of their workers is stopped;
2. the cut heals: the node rejoins (world 3 again);
3. the leader is cut off: the majority (the two others, with etcd) elects a new leader once the
   ex-leader's lease has expired and trains on at world 2; the ex-leader, alone, does not drive a
   world of its own (no world formed, no step trained there), stepped down before the new leader
   was elected, and a write fenced by its old term fails;
4. that cut heals: the ex-leader rejoins as a normal node (world 3);
and every finished epoch trained each sample exactly once (committed work).

The test process stays in the root namespace and never reaches etcd itself: it reads the workers'
trace files and the agents' logs, and etcd through a small process inside etcd's namespace.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.engines.horovod.failures import excluded_hosts
from elasticyolo.engines.world_health import etcd_answers
from support import netns
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from support.netns import NetLab, NetnsEtcdReader
from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.local_cluster.trace import coverage_by_epoch, pids_by_rank

N_TRAIN = 24
TTL = 4  # heartbeat timeout: the default, min(2, 0.75 x TTL) = 2 s
NODES = ("a", "b", "c")
START_S, STEP_S = 240, 120


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=N_TRAIN, val=4, imgsz=64, classes=2))


@dataclass
class Lab:
    net: NetLab
    cluster: AgentCluster


@pytest.fixture
def lab(job_name: str, tmp_path: Path) -> Iterator[Lab]:
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    with contextlib.ExitStack() as stack:
        net = stack.enter_context(NetLab())  # closed last: kills what is left in it, deletes it
        member = net.add("etcd")
        for n in NODES:
            net.add(n)
        etcd = stack.enter_context(EtcdCluster(host=member.addr, exec_prefix=net.prefix("etcd")))
        c = AgentCluster(etcd.endpoints, job_name, tmp_path, ttl=TTL, loopback=False,
                         reader=NetnsEtcdReader(net, "etcd", etcd.endpoints), cli_prefix=net.prefix("etcd"),
                         env={"OMP_NUM_THREADS": "1", "ELASTICYOLO_SNAPSHOT_S": "2"})
        stack.callback(c.stop)

        @stack.callback
        def heal_all() -> None:  # first: agents leave cleanly with their links up
            for n in NODES:
                net.heal(n)

        yield Lab(net, c)




def worker_pids(c: AgentCluster, node: str) -> set[int]:
    """Every worker `node`'s agent has started (its log), warm or not."""
    return {int(r["pid"]) for r in c.logs(node) if r.get("event") == "worker started" and r.get("pid")}


def logged(c: AgentCluster, node: str, *events: str) -> list[tuple[float, dict[str, Any]]]:
    """(unix time, record) of `node`'s agent log lines whose event starts with one of `events`."""
    return [(datetime.fromisoformat(r["timestamp"]).timestamp(), r) for r in c.logs(node)
            if str(r.get("event")).startswith(events) and r.get("timestamp")]


# What a driver does when it takes nodes for lost (driver.py, and Horovod's own log lines).
DRIVING = ("aborting the world's collective", "node lost; counting its worker as failed", "blacklist failing host")


def fenced_write_succeeds(lab: Lab, node: str, term: int) -> bool:
    """A write fenced by leader term `term` (as `LeaderElection.fenced_put` does it), from `node`."""
    c = lab.cluster
    code = ("import json, sys; from elasticyolo.cluster.etcd import EtcdClient, b64\n"
            "endpoints, leader, term, key = sys.argv[1:5]\n"
            "r = EtcdClient(endpoints).txn([{'key': b64(leader), 'result': 'EQUAL', 'target': 'MOD',"
            " 'mod_revision': term}], [{'request_put': {'key': b64(key), 'value': b64('{}')}}], [])\n"
            "print(json.dumps(r['succeeded']))")
    r = lab.net.run(node, [sys.executable, "-c", code, c.endpoints, c.keys.leader, str(term),
                           c.keys.prefix + "fence-probe"])
    assert r.returncode == 0, r.stderr
    return bool(json.loads(r.stdout))


def test_a_leader_acts_on_liveness_only_while_etcd_answers() -> None:
    """The rules that keep a cut-off leader from forming a world of its own (failures.py)."""
    assert etcd_answers(0.2, 2.0) and not etcd_answers(1.9, 2.0)
    # etcd answers: every lost node is left out; it does not: none newly, and none put back.
    assert excluded_hosts({"a", "b"}, set(), True) == {"a", "b"}
    assert excluded_hosts({"a", "b"}, set(), False) == set()
    assert excluded_hosts({"a", "b"}, {"a", "c"}, False) == {"a"}


# About 1-2 minutes on a 2-core VM (worker warm-ups, two lease expiries, two rejoins); in
# `make test`.
def test_partition_and_heal(lab: Lab, dataset: Path) -> None:
    net, c = lab.net, lab.cluster
    for n in NODES:
        c.start(n, "--drain-timeout-s", "5", addr=net.members[n].addr, prefix=net.prefix(n))
    c.wait(lambda: c.ready(list(NODES)) and c.leader(), 60, "three agents and a leader")
    c.submit("engine=horovod", "model=yolov8n.yaml", f"data={dataset}", "epochs=400", "imgsz=64", "batch=4", "nbs=4",
             "warmup_epochs=0", "close_mosaic=0", "commit_every=1", "val=false", "min_nodes=1",
             "gloo_timeout_s=30", "cooldown_s=1,2")
    c.wait(lambda: len(c.rank0_steps_after(0, 3)) >= 2, START_S, "steps at world size 3")
    leader = c.leader()
    assert leader is not None
    x, y = [n for n in NODES if n != leader]

    # 1. Cut a non-leader: the leader and y train on at world 2, with the same workers.
    healthy = {c.worker_of(leader), c.worker_of(y)}
    net.cut(x)
    t1 = time.time()
    first = c.wait(lambda: c.rank0_steps_after(t1, 2), STEP_S, f"world 2 without the cut node {x}")[0]
    cut_to_world2 = first["t"] - t1
    assert cut_to_world2 < 30, "the world waited out Gloo's timeout instead of the heartbeat timeout"
    assert set(pids_by_rank([e for e in c.events() if e["t"] > t1]).values()) == healthy
    assert all(psutil.pid_exists(p) for p in healthy), "a healthy worker was stopped"
    c.wait(lambda: x not in c.nodes(), 3 * TTL, f"the cut node {x}'s record to expire")
    assert c.job_state() == "running"

    # 2. Heal: x comes back and the world grows to 3 again.
    net.heal(x)
    t2 = time.time()
    first = c.wait(lambda: c.rank0_steps_after(t2, 3), START_S, f"the healed node {x} back in the world")[0]
    heal_to_world3 = first["t"] - t2

    # 3. Cut the leader. The majority (x, y and etcd) elects a new leader after the ex-leader's
    #    lease expired and trains on at world 2; the ex-leader drives nothing meanwhile.
    ex = leader
    old_term = c.reader.get(c.keys.leader)
    assert old_term is not None
    ex_workers_before = worker_pids(c, ex)
    net.cut(ex)
    t3 = time.time()
    new_leader = c.wait(lambda: (lambda l: l if l not in (None, ex) else None)(c.leader()), 3 * TTL + STEP_S,
                        "a new leader on the majority side")
    assert ex not in c.nodes(), "a new leader while the ex-leader's lease was still there"
    first = c.wait(lambda: c.rank0_steps_after(t3, 2), STEP_S + START_S, "world 2 under the new leader")[0]
    leader_cut_to_resume = first["t"] - t3
    world = c.world()
    assert world.get("leader") == new_leader and world.get("term", 0) > old_term[1], world

    # 4. Heal: the ex-leader rejoins as a normal node, and the world is 3 again.
    net.heal(ex)
    t4 = time.time()
    first = c.wait(lambda: c.rank0_steps_after(t4, 3), START_S, f"the ex-leader {ex} back in the world")[0]
    heal_leader_to_world3 = first["t"] - t4
    assert c.leader() == new_leader
    assert c.nodes()[ex].get("leader") is False
    assert c.job_state() == "running"

    # Fencing: cut off, the ex-leader did not take the others' silence for their loss (it is its
    # own), stepped down on its own (its lease may have expired), formed no world and trained no
    # step, and a write fenced by its old term fails.
    driven = [r for t, r in logged(c, ex, *DRIVING) if t3 < t < t4]
    assert not driven, f"the cut-off ex-leader drove its world: {driven[:3]}"
    stepped_down = [t for t, _ in logged(c, ex, "lost leadership") if t3 < t < t4]
    assert stepped_down, f"the ex-leader {ex} did not step down while cut off"
    ex_workers = worker_pids(c, ex)
    assert ex_workers_before <= ex_workers
    cut_off = [e for e in c.events() if t3 < e["t"] < t4 and e["pid"] in ex_workers]
    worlds = [e for e in cut_off if e["ev"] in ("reset", "resume")]
    assert not worlds, f"the cut-off ex-leader formed a world: {worlds}"
    # A step record is written before its allreduce: one world-3 step may be in flight at the cut.
    steps = [e for e in cut_off if e["ev"] == "step"]
    assert all(e["world"] == 3 for e in steps) and len(steps) <= len({e["pid"] for e in steps}), \
        f"the cut-off ex-leader trained: {steps[:3]}"
    assert not fenced_write_succeeds(lab, ex, old_term[1]), "a write fenced by the old term succeeded"

    print(f"\npartition figures: cut -> world 2 step {cut_to_world2:.1f} s; heal -> world 3 step "
          f"{heal_to_world3:.1f} s; leader cut -> world 2 step under {new_leader} {leader_cut_to_resume:.1f} s; "
          f"ex-leader heal -> world 3 step {heal_leader_to_world3:.1f} s; the ex-leader stepped down "
          f"{min(stepped_down) - t3:.1f} s after its cut")

    # Every finished epoch trained each sample exactly once through all of that.
    cov = coverage_by_epoch(c.events())
    done = [e for e in sorted(cov) if e < max(cov)]
    assert done, "no epoch finished"
    for epoch in done:
        assert sorted(cov[epoch]) == list(range(N_TRAIN)), f"epoch {epoch}: duplicates or gaps"
