"""`elasticyolo status`: JSON shape, table, progress/checkpoint records, speed, no torch."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.cluster.registry import NodeRecord
from elasticyolo.local_cluster.agents import ELASTICYOLO
from elasticyolo.status import collect, render_table
from support.pty import run_on_pty
from elasticyolo.local_cluster.servers import EtcdCluster


def seed(e: EtcdClient, keys: JobKeys) -> None:
    lease = e.lease_grant(30)
    for i, pre in enumerate((False, True, True)):
        rec = NodeRecord(node_id=f"gpu-{i}", host=f"h{i}", addr="127.0.0.1", slots=1, state="TRAINING",
                         preemptible=pre, price_per_hour=0.5 + i, started_at=time.time() - 90,
                         leader=(i == 0), notice={"action": "terminate", "time": "2026-01-01T00:00:00Z"} if i == 2 else None)
        e.put(keys.node(rec.node_id), rec.to_json(), lease=lease)
    e.put(keys.leader, json.dumps({"node_id": "gpu-0", "since": time.time(), "preemptible": False}), lease=lease)
    e.put(keys.spec, json.dumps({"data": "d.yaml", "epochs": 5}))
    e.put(keys.state, json.dumps({"state": "running", "at": time.time()}))
    e.put(keys.world, json.dumps({"world_size": 3, "ranks": {"gpu-0": [0], "gpu-1": [1], "gpu-2": [2]}}))
    e.put(keys.progress, json.dumps({"epoch": 2, "step": 340, "samples_s": 123.4, "world_size": 3, "at": time.time()}))
    e.put(keys.checkpoint_latest, json.dumps({"uri": "s3://b/job/step-300", "epoch": 2, "step": 300,
                                              "at": time.time() - 30}))


def test_collect_and_render(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    keys = JobKeys(job_name)
    empty = collect(e, keys)
    assert empty["state"] == "none" and empty["nodes"] == [] and empty["leader"] is None
    assert "no nodes registered" in render_table(empty)
    seed(e, keys)
    v = collect(e, keys)
    for field in ("job", "state", "world_size", "leader", "nodes", "epoch", "step", "last_checkpoint"):
        assert field in v
    assert (v["state"], v["world_size"], v["leader"], v["epoch"], v["step"], v["samples_s"]) == \
        ("running", 3, "gpu-0", 2, 340, 123.4)
    assert v["last_checkpoint"]["uri"] == "s3://b/job/step-300"
    n0, n1, n2 = v["nodes"]
    assert n0["leader"] and not n1["leader"] and n0["preemptible"] is False and n1["ranks"] == [1]
    assert 25 <= n0["lease_ttl_s"] <= 30 and 85 <= n0["age_s"] <= 200
    assert n2["notice"]["action"] == "terminate"
    table = render_table(v)
    lines = table.splitlines()
    assert lines[0].startswith(f"JOB {job_name}  STATE running  WORLD 3  EPOCH 2  STEP 340  SAMPLES/S 123.40")
    assert "s3://b/job/step-300 (epoch 2, step 300, 30s ago)" in lines[1] or "31s ago" in lines[1]
    assert lines[2].startswith("COST $") and "BURN $4.500/h" in lines[2]  # 0.5 + 1.5 + 2.5 per hour
    header = lines[4].split()
    assert header[:6] == ["NODE", "STATE", "SLOTS", "RANKS", "LEADER", "LEASE"]
    assert set(lines[5]) == {"─"}  # rich's header rule
    row0 = lines[6].split()
    assert row0[0] == "gpu-0" and "*" in row0 and "terminate@2026-01-01T00:00:00Z" in lines[8]


def test_status_cli_json_and_speed(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    seed(e, JobKeys(job_name))
    cmd = [ELASTICYOLO, "status", "--etcd", etcd_server.endpoints, "--job", job_name, "--json"]
    subprocess.run(cmd, capture_output=True, timeout=30)  # warm the page cache
    best = 1e9
    for _ in range(3):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        best = min(best, time.perf_counter() - t0)
        assert r.returncode == 0, r.stderr
    view = json.loads(r.stdout)
    assert [n["id"] for n in view["nodes"]] == ["gpu-0", "gpu-1", "gpu-2"] and view["leader"] == "gpu-0"
    # "well under 0.3 s" on a quiet machine; other work shares these 2 cores, so allow slack here
    # (bench/membership.py reports the real figure).
    assert best < 0.6, f"status took {best:.3f}s"
    table = subprocess.run(cmd[:-1], capture_output=True, text=True, timeout=30)
    assert table.returncode == 0 and table.stdout.startswith(f"JOB {job_name}")


def test_status_watch_prints_repeatedly(etcd_server: EtcdCluster, job_name: str) -> None:
    proc = subprocess.Popen([ELASTICYOLO, "status", "--etcd", etcd_server.endpoints, "--job", job_name, "--json",
                             "--watch", "--interval", "0.2"], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        objs = [json.loads(proc.stdout.readline()) for _ in range(3)]
        assert all(o["job"] == job_name for o in objs)
    finally:
        proc.terminate()
        proc.wait(10)


def test_cli_paths_never_import_torch() -> None:
    code = ("import sys, elasticyolo.cli, elasticyolo.commands.status, elasticyolo.commands.agent, "
            "elasticyolo.commands.submit, elasticyolo.commands.cancel, elasticyolo.status, elasticyolo.agent.daemon, "
            "elasticyolo.config; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'ultralytics', "
            "'torchvision', 'horovod')]; assert not bad, bad; "
            "import elasticyolo.commands.status as s; import importlib; "
            "print('ok')")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    # the status path stays light: no pydantic, no structlog
    code2 = ("import sys, elasticyolo.commands.status, elasticyolo.status; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'pydantic', 'structlog', 'torch', 'yaml'}))")
    r2 = subprocess.run([sys.executable, "-c", code2], capture_output=True, text=True, timeout=60)
    assert r2.stdout.strip() == "[]", r2.stdout + r2.stderr


def test_status_table_and_watch_on_a_terminal(etcd_server: EtcdCluster, job_name: str) -> None:
    e = EtcdClient(etcd_server.endpoints)
    seed(e, JobKeys(job_name))
    base = [ELASTICYOLO, "status", "--etcd", etcd_server.endpoints, "--job", job_name]
    rc, text = run_on_pty(base, until=lambda out: False)
    assert rc == 0 and "NODE" in text and "gpu-2" in text and "COST $" in text, text
    assert "\x1b[" in text  # a terminal gets colour
    # --watch redraws in place until Ctrl-C, then leaves the terminal as it was and exits 0.
    rc, text = run_on_pty(base + ["--watch", "--interval", "0.2"], interrupt=True,
                        until=lambda out: out.count("every 0.2s") >= 3)
    assert rc == 0, text
    assert text.count("every 0.2s") >= 3 and "gpu-0" in text and "Traceback" not in text
    assert "\x1b[?1049h" in text and "\x1b[?1049l" in text  # alternate screen entered and left


def test_big_tables_keep_the_layout_and_stay_fast() -> None:
    from elasticyolo.status import RICH_MAX_ROWS

    def view(n: int) -> dict:
        nodes = [{"id": f"node-{i:04d}", "state": "TRAINING", "slots": 8, "ranks": [i], "leader": i == 0,
                  "lease_ttl_s": 4, "age_s": 600, "notice": None, "price_per_hour": 0.4, "spent_usd": 0.1,
                  "preemptible": True} for i in range(n)]
        return {"job": "j", "state": "running", "world_size": n, "epoch": 1, "step": 1, "samples_s": 1.0,
                "leader": "node-0000", "leader_term": 1, "last_checkpoint": None, "cost": {}, "goodput": {},
                "nodes": nodes, "events": []}

    small = render_table(view(3)).splitlines()
    t0 = time.perf_counter()
    big = render_table(view(RICH_MAX_ROWS + 800)).splitlines()
    assert time.perf_counter() - t0 < 1.0
    assert len(big) == 4 + 2 + RICH_MAX_ROWS + 800
    assert big[4] == small[4] and big[6] == small[6]  # header and first row, as rich draws them
