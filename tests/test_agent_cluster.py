"""Scenarios with real `elasticyolo agent` processes against real etcd on 127.0.0.1.

Each scenario is a schedule of joins/kills plus polling with deadlines (no bare sleeps).
TTL is 2 s to keep them fast.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.local_cluster.agents import ELASTICYOLO, AgentProcess, LeaderMonitor, leader_in_etcd, nodes_in_etcd
from elasticyolo.local_cluster.servers import EtcdCluster, free_port
from elasticyolo.local_cluster.wait import wait_for

TTL = 2


def start(agents: list[AgentProcess], endpoints: str, job: str, node_id: str, tmp: Path, *extra: str,
          env: dict[str, str] | None = None) -> AgentProcess:
    a = AgentProcess(endpoints, job, node_id, ttl=TTL, log_dir=tmp, extra=list(extra), env=env or {}).start()
    agents.append(a)
    return a


def status_json(endpoints: str, job: str) -> dict:  # type: ignore[type-arg]
    r = subprocess.run([ELASTICYOLO, "status", "--etcd", endpoints, "--job", job, "--json"],
                       capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)  # type: ignore[no-any-return]


def test_join_kill_member_kill_leader(etcd_server: EtcdCluster, job_name: str, agents: list[AgentProcess],
                                      tmp_path: Path) -> None:
    ep = etcd_server.endpoints
    e = EtcdClient(ep)
    by_id = {n: start(agents, ep, job_name, n, tmp_path) for n in ("a", "b", "c")}

    # 1. three agents join: status lists three nodes and exactly one leader
    wait_for(lambda: len(nodes_in_etcd(e, job_name)) == 3 and leader_in_etcd(e, job_name), 15, "3 nodes + leader")
    view = status_json(ep, job_name)
    assert sorted(n["id"] for n in view["nodes"]) == ["a", "b", "c"]
    assert sum(n["leader"] for n in view["nodes"]) == 1 and view["leader"] in by_id
    assert all(n["state"] == "IDLE" and n["lease_ttl_s"] is not None and 0 <= n["lease_ttl_s"] <= TTL
               for n in view["nodes"])
    # Registered with no warm worker: Horovod's discovery is offered no slot of theirs yet (an
    # absent field would offer every slot, and a join would stall the world for the warm-up).
    assert all(rec.get("ready_slots") == 0 for rec in nodes_in_etcd(e, job_name).values())

    with LeaderMonitor(e, job_name) as monitor:
        # 2. SIGKILL a non-leader: its node leaves status within TTL + 2 s
        leader = view["leader"]
        victim = next(n for n in by_id if n != leader)
        by_id[victim].kill()
        t0 = time.monotonic()
        wait_for(lambda: victim not in [n["id"] for n in status_json(ep, job_name)["nodes"]], TTL + 2,
                 f"killed node {victim} to leave status")
        gone_after = time.monotonic() - t0
        assert leader_in_etcd(e, job_name) == leader  # the leader is undisturbed

        # 3. a new node joins
        by_id["d"] = start(agents, ep, job_name, "d", tmp_path)
        wait_for(lambda: "d" in nodes_in_etcd(e, job_name), 10, "node d to join")

        # 4. SIGKILL the leader: a new leader within TTL + 2 s, never two at once
        by_id[leader].kill()
        t0 = time.monotonic()
        new_leader = wait_for(lambda: (lambda l: l if l not in (None, leader) else None)(leader_in_etcd(e, job_name)),
                              TTL + 2, "a new leader")
        failover = time.monotonic() - t0
        wait_for(lambda: leader not in nodes_in_etcd(e, job_name), TTL + 2, "the dead leader's node to expire")
        assert new_leader in by_id and by_id[new_leader].proc.poll() is None  # type: ignore[union-attr]
        # The monitor samples on its own thread: let it observe the new leader too.
        wait_for(lambda: new_leader in monitor.leaders_seen, 5, "the monitor to see the new leader")
    assert monitor.samples > 50, "the leader monitor did not run"
    assert monitor.violations == []
    assert monitor.leaders_seen == [leader, new_leader]
    print(f"non-leader gone after {gone_after:.2f}s, leader failover {failover:.2f}s (TTL {TTL}s)")


def test_sigterm_drains_then_leaves_and_revokes_lease(etcd_server: EtcdCluster, job_name: str,
                                                      agents: list[AgentProcess], tmp_path: Path) -> None:
    ep = etcd_server.endpoints
    e = EtcdClient(ep)
    first = start(agents, ep, job_name, "first", tmp_path)
    wait_for(lambda: leader_in_etcd(e, job_name) == "first", 15, "first to lead")
    second = start(agents, ep, job_name, "second", tmp_path)
    wait_for(lambda: nodes_in_etcd(e, job_name).get("second", {}).get("state") == "IDLE", 10, "second IDLE")

    with LeaderMonitor(e, job_name) as monitor:
        t0 = time.monotonic()
        first.signal(signal.SIGTERM)
        assert first.proc is not None and first.proc.wait(10) == 0
        exited = time.monotonic() - t0
        # lease revoked: the node is gone at once (not after TTL), and leadership moves on promptly
        assert "first" not in nodes_in_etcd(e, job_name)
        wait_for(lambda: leader_in_etcd(e, job_name) == "second", 1.5, "second to take over quickly")
    assert monitor.violations == []
    assert exited < TTL
    events = [json.loads(v) for _, v, _ in e.get_prefix(JobKeys(job_name).events)]
    mine = [(ev["from"], ev["to"]) for ev in events if ev["node"] == "first" and ev["kind"] == "state"]
    assert mine[-2:] == [("IDLE", "DRAINING"), ("DRAINING", "LEFT")]
    logged = [r.get("to_state") for r in first.log_records() if r.get("event") == "state transition"]
    assert logged[-2:] == ["DRAINING", "LEFT"]
    assert any(r.get("event") == "left the cluster" and r.get("lease_revoked") for r in first.log_records())


def test_etcd_member_failure_keeps_registrations(etcd_cluster3: EtcdCluster, job_name: str,
                                                 agents: list[AgentProcess], tmp_path: Path) -> None:
    c = etcd_cluster3
    ep = c.endpoints  # the member we kill is listed first
    e = EtcdClient(ep, timeout=1.0)
    for n in ("x", "y", "z"):
        start(agents, ep, job_name, n, tmp_path)
    wait_for(lambda: len(nodes_in_etcd(e, job_name)) == 3 and leader_in_etcd(e, job_name), 15, "3 nodes + leader")
    leader = leader_in_etcd(e, job_name)
    c.kill_member(c.members[0])
    # For longer than a TTL (plus an etcd election), every registration stays and status answers.
    survivors = ",".join(m.endpoint for m in c.members[1:])
    es = EtcdClient(survivors, timeout=1.0)
    end = time.monotonic() + TTL * 2 + 1
    answers = 0
    while time.monotonic() < end:
        view = status_json(ep, job_name)
        answers += 1
        assert sorted(n["id"] for n in view["nodes"]) == ["x", "y", "z"], view
        assert view["leader"] == leader
    assert answers >= 3
    assert sorted(nodes_in_etcd(es, job_name)) == ["x", "y", "z"]
    assert all(a.proc is not None and a.proc.poll() is None for a in agents)


def test_non_preemptible_node_takes_over_leadership(etcd_server: EtcdCluster, job_name: str,
                                                    agents: list[AgentProcess], tmp_path: Path) -> None:
    ep = etcd_server.endpoints
    e = EtcdClient(ep)
    start(agents, ep, job_name, "spot-1", tmp_path, "--preemptible")
    wait_for(lambda: leader_in_etcd(e, job_name) == "spot-1", 15, "spot-1 to lead while alone")
    with LeaderMonitor(e, job_name) as monitor:
        start(agents, ep, job_name, "ondemand-1", tmp_path, "--no-preemptible")
        wait_for(lambda: leader_in_etcd(e, job_name) == "ondemand-1", 10, "the non-preemptible node to lead")
        start(agents, ep, job_name, "spot-2", tmp_path, "--preemptible")
        wait_for(lambda: nodes_in_etcd(e, job_name).get("spot-2", {}).get("state") == "IDLE", 10, "spot-2 IDLE")
    assert leader_in_etcd(e, job_name) == "ondemand-1"
    assert monitor.violations == []


def test_submit_and_cancel_move_agents_between_idle_and_training(etcd_server: EtcdCluster, job_name: str,
                                                                 agents: list[AgentProcess], tmp_path: Path) -> None:
    ep = etcd_server.endpoints
    e = EtcdClient(ep)
    start(agents, ep, job_name, "n1", tmp_path)
    start(agents, ep, job_name, "n2", tmp_path)
    states = lambda: {k: v["state"] for k, v in nodes_in_etcd(e, job_name).items()}  # noqa: E731
    wait_for(lambda: states() == {"n1": "IDLE", "n2": "IDLE"}, 15, "agents idle without a spec")
    r = subprocess.run([ELASTICYOLO, "submit", "--etcd", ep, "--job", job_name, "model=yolov8n.yaml",
                        "data=/nodes/only/data.yaml", "epochs=3", "imgsz=128", "batch=4", "engine=torch",
                        "min_nodes=1", "max_nodes=4"], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: states() == {"n1": "TRAINING", "n2": "TRAINING"}, 10, "agents TRAINING after submit")
    view = status_json(ep, job_name)
    assert view["state"] == "submitted" and view["spec"]["engine"] == "torch" and view["spec"]["epochs"] == 3
    again = subprocess.run([ELASTICYOLO, "submit", "--etcd", ep, "--job", job_name, "data=d.yaml"],
                           capture_output=True, text=True, timeout=20)
    assert again.returncode == 2 and "already has a spec" in again.stderr
    r = subprocess.run([ELASTICYOLO, "cancel", "--etcd", ep, "--job", job_name], capture_output=True, text=True,
                       timeout=20)
    assert r.returncode == 0, r.stderr
    wait_for(lambda: states() == {"n1": "IDLE", "n2": "IDLE"}, 10, "agents IDLE after cancel")
    assert status_json(ep, job_name)["state"] == "cancelled"


def test_config_spec_is_submitted_and_metrics_served(etcd_server: EtcdCluster, job_name: str,
                                                     agents: list[AgentProcess], tmp_path: Path) -> None:
    ep = etcd_server.endpoints
    e = EtcdClient(ep)
    cfg = tmp_path / "agent.yaml"
    cfg.write_text("zone: test-a\nprice_per_hour: 0.9\nspec:\n  data: /data/coco.yaml\n  epochs: 2\n")
    port = free_port()
    a = AgentProcess(ep, job_name, "m1", ttl=TTL, log_dir=tmp_path,
                     extra=["--metrics-port", str(port)], env={"ELASTICYOLO_CONFIG": str(cfg)})
    # AgentProcess passes --config /dev/null; the env path must lose to it, so drop that flag here.
    a.start = _start_with_config(a, cfg)  # type: ignore[method-assign]
    a.start()
    agents.append(a)
    wait_for(lambda: nodes_in_etcd(e, job_name).get("m1", {}).get("state") == "TRAINING", 15, "m1 TRAINING")
    rec = nodes_in_etcd(e, job_name)["m1"]
    assert rec["zone"] == "test-a" and rec["price_per_hour"] == 0.9
    text = wait_for(lambda: urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode(),
                    5, "metrics endpoint")
    assert 'elasticyolo_node_state{job="%s",node="m1",state="TRAINING"} 1.0' % job_name in text
    assert "elasticyolo_is_leader" in text and "elasticyolo_lease_renew_seconds_count" in text
    # bound to loopback only
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) == 0


def _start_with_config(a: AgentProcess, cfg: Path):  # type: ignore[no-untyped-def]
    import os

    def start() -> AgentProcess:
        cmd = [ELASTICYOLO, "agent", "--config", str(cfg), "--etcd", a.endpoints, "--job", a.job, "--node-id",
               a.node_id, "--ttl", str(a.ttl), "--addr", "127.0.0.1", *a.extra]
        log = open(a.log_path, "ab")
        a.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                  env={**os.environ, "ELASTICYOLO_LOG_FORMAT": "json",
                                       "ELASTICYOLO_WORK_DIR": str(a.log_dir / "nodes")})
        log.close()
        return a

    return start
