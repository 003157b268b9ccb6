"""Failures where the user looks, through real agents on a real etcd: a worker's fatal error in
`status --json` and in the failed job's reason, `submit --follow` exiting with it, `logs` showing
the workers' lines from the job's store; and `submit`'s own checks of the spec and the data path."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.agents import ELASTICYOLO
from elasticyolo.local_cluster.servers import EtcdCluster

MISSING = "data.yaml not found"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ELASTICYOLO, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_missing_data_on_the_nodes_reaches_status_follow_and_logs(cluster: AgentCluster, tmp_path: Path) -> None:
    c = cluster
    for node in ("n1", "n2"):
        c.start(node)
    c.wait(lambda: c.ready(["n1", "n2"]) and c.leader(), 30, "two agents and a leader")
    data = tmp_path / "only-on-the-submitter" / "data.yaml"
    store = tmp_path / "store"
    follow = subprocess.Popen(
        [ELASTICYOLO, "submit", "--etcd", c.endpoints, "--job", c.job, "--follow", "--interval", "0.2",
         "model=yolov8n.yaml", f"data={data}", "imgsz=64", "batch=2", "min_nodes=2", f"checkpoint=file://{store}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, **c.env})
    try:
        # The first worker that fails (a warm one, or a plain one) is in status within 10 s.
        view = c.wait(lambda: (v := c.status())["worker_errors"] and v, 120, "a worker error in status --json")
        seen_at = time.time()
        first = min(view["worker_errors"], key=lambda e: e["at"])
        assert first["node"] in ("n1", "n2") and first["reason"] == f"{data}: {MISSING}", first
        assert first["code"] == 2 and first["slot"] == 0, first
        assert seen_at - first["at"] < 10, f"{seen_at - first['at']:.1f} s from the failure to status"
        assert f"{first['node']}: {data}: {MISSING}" in c.status(as_json=False)

        out, err = follow.communicate(timeout=240)
    finally:
        if follow.poll() is None:
            follow.kill()
    # The job failed with the workers' reason, and --follow said so.
    view = c.status()
    assert view["state"] == "failed" and f"{data}: {MISSING}" in view["reason"], view["reason"]
    assert follow.returncode == 1, (out, err)
    assert err.strip().splitlines()[-1] == f"elasticyolo submit: error: job {c.job} failed: {view['reason']}", err
    assert "submitted" in out and "error n" in out and MISSING in out, out  # one line per change

    # `logs`: the agents shipped their logs, the workers' lines included, to the job's store.
    def shipped() -> str | None:
        r = cli("logs", c.job, "--etcd", c.endpoints)
        assert r.returncode == 0, r.stderr
        return r.stdout if f"elasticyolo worker: error: {data}: {MISSING}" in r.stdout else None

    out = c.wait(shipped, 20, "the workers' output in `logs`")
    worker_lines = [ln for ln in out.splitlines() if "worker output" in ln and MISSING in ln]
    assert {ln.split()[0] for ln in worker_lines} <= {"n1", "n2"} and worker_lines, out
    assert any("worker failed" in ln for ln in out.splitlines()), out  # the agent's own record
    one = cli("logs", c.job, "--etcd", c.endpoints, "--node", "n2", "--tail", "3")
    assert one.returncode == 0 and len(one.stdout.splitlines()) == 3, one
    assert all(ln.startswith("n2  ") for ln in one.stdout.splitlines()), one.stdout
    raw = cli("logs", c.job, "--etcd", c.endpoints, "--raw", "--tail", "1")
    assert all(json.loads(ln.split("  ", 1)[1]) for ln in raw.stdout.splitlines()), raw.stdout
    # --follow ends once the job has ended and nothing more arrives.
    followed = cli("logs", c.job, "--etcd", c.endpoints, "--follow", "--tail", "0", "--interval", "0.5")
    assert followed.returncode == 0, followed.stderr


def test_submit_refuses_a_malformed_spec_in_one_line(etcd_server: EtcdCluster, job_name: str) -> None:
    for pairs, needle in ((["data=d.yaml", "epochs=ten"], "epochs: Input should be a valid integer"),
                          (["data=d.yaml", "epochs"], "expected key=value, got 'epochs'"),
                          (["data=d.yaml", "colour=red"], "unknown option 'colour'"),
                          (["data=d.yaml", "batch=0"], "batch: Input should be greater than or equal to 1"),
                          (["epochs=3"], "data: Field required")):
        r = cli("submit", "--etcd", etcd_server.endpoints, "--job", job_name, *pairs)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and needle in r.stderr, (pairs, r.stderr)
        assert r.stderr.startswith("elasticyolo submit: error: ") and "Traceback" not in r.stderr
    assert EtcdClient(etcd_server.endpoints).get(JobKeys(job_name).spec) is None  # nothing written


def test_submit_warns_when_the_data_path_is_not_here(etcd_server: EtcdCluster, job_name: str,
                                                     tmp_path: Path) -> None:
    missing = tmp_path / "data.yaml"
    r = cli("submit", "--etcd", etcd_server.endpoints, "--job", job_name, f"data={missing}")
    assert r.returncode == 0 and "submitted" in r.stdout, r
    assert r.stderr == (f"elasticyolo submit: warning: data={missing} does not exist on this machine; every node "
                        "must have it at that path (or use data=s3://.../data.yaml, staged to each node)\n")
    missing.write_text("train: x\n")
    for data in (str(missing), "s3://bucket/sets/data.yaml"):
        r = cli("submit", "--etcd", etcd_server.endpoints, "--job", job_name, "--replace", f"data={data}")
        assert r.returncode == 0 and r.stderr == "", r
