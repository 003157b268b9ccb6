"""Production shape end to end: a 3-member etcd cluster set up by deploy/etcd (TLS for clients
and peers, client certificates required, JWT tokens, auth on with a role limited to
/elasticyolo/), real agents and Horovod workers training through it on a dataset staged from the
local S3 server, checkpoints encrypted with SSE-KMS; a member is killed mid-training; nothing
leaks the password or the private key into logs, `ps`, etcd or the checkpoints.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import boto3
import psutil
import pytest

from elasticyolo.cluster.etcd import EtcdClient, EtcdError
from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.errors import UserError
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.agents import ELASTICYOLO
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.staging.upload import upload_dataset
from support.s3proxy import S3FaultProxy
from elasticyolo.local_cluster.servers import EtcdCluster, EtcdPki, S3Server

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None or shutil.which("etcdctl") is None,
                                reason="openssl and etcdctl are needed")
KMS_KEY = "arn:aws:kms:us-east-1:123456789012:key/0f1e2d3c-elasticyolo-test"


@dataclass
class Secure:
    pki: EtcdPki
    cluster: EtcdCluster
    password: str
    password_file: Path

    def env(self) -> dict[str, str]:
        """TLS and auth for agents, workers and the CLI: files only, never the password."""
        cert, key = self.pki.client()
        return {"ELASTICYOLO_ETCD_CA": self.pki.ca, "ELASTICYOLO_ETCD_CERT": cert, "ELASTICYOLO_ETCD_KEY": key,
                "ELASTICYOLO_ETCD_USER": "elasticyolo", "ELASTICYOLO_CONFIG": os.devnull}

    def client(self, endpoints: str | None = None) -> EtcdClient:
        return EtcdClient(endpoints or self.cluster.endpoints, user="elasticyolo", password=self.password,
                          **self.pki.client_kwargs())

    def key_material(self) -> list[str]:
        """Lines of the client private key's PEM body: none may appear anywhere."""
        body = Path(self.pki.client()[1]).read_text().splitlines()
        return [ln for ln in body if ln and not ln.startswith("-----")] + ["PRIVATE KEY"]


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    d = tmp_path_factory.mktemp("secure")
    pki = EtcdPki.generate(d / "pki", ["m0", "m1", "m2"])
    password = "pw-" + secrets.token_urlsafe(18)
    pw = d / "etcd-password"
    pw.write_text(password + "\n")
    pw.chmod(0o600)
    cluster = EtcdCluster(size=3, tls=pki).start()
    try:
        cluster.enable_auth(pw)
        yield Secure(pki, cluster, password, pw)
    finally:
        cluster.stop()


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ELASTICYOLO, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ELASTICYOLO_LOG_FORMAT": "json", **env})


def _one_line(r: subprocess.CompletedProcess[str], needle: str) -> str:
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], (r.returncode, r.stderr)
    return lines[0]


def test_bad_certificate_or_password_is_refused_in_one_line(secure: Secure, tmp_path: Path) -> None:
    ep = secure.cluster.endpoints
    env = {**secure.env(), "ELASTICYOLO_ETCD_PASSWORD_FILE": str(secure.password_file)}
    ok = _cli("status", "--etcd", ep, "--job", "nobody-here", "--json", env=env)
    assert ok.returncode == 0 and json.loads(ok.stdout)["state"] == "none", ok.stderr

    no_cert = {k: v for k, v in env.items() if k not in ("ELASTICYOLO_ETCD_CERT", "ELASTICYOLO_ETCD_KEY")}
    _one_line(_cli("status", "--etcd", ep, "--job", "x", env=no_cert), "requires a client certificate")
    other = EtcdPki.generate(tmp_path / "other", ["m0"])
    cert, key = other.client()
    _one_line(_cli("status", "--etcd", ep, "--job", "x", env={**env, "ELASTICYOLO_ETCD_CERT": cert,
                                                               "ELASTICYOLO_ETCD_KEY": key}),
              "does not accept our client certificate")
    # TLS 1.3: the server's verdict on our certificate comes after our side of the handshake, and a
    # request that crosses its alert sees only EOF (most tries under load): every try must still say why.
    for _ in range(20):
        with pytest.raises(UserError, match="does not accept our client certificate"):
            EtcdClient(ep, ca_cert=secure.pki.ca, cert_cert=cert, cert_key=key, timeout=2).get("/elasticyolo/x")
    _one_line(_cli("status", "--etcd", ep, "--job", "x", env={**env, "ELASTICYOLO_ETCD_CA": other.ca}),
              "certificate is not trusted")
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    line = _one_line(_cli("status", "--etcd", ep, "--job", "x", env={**env, "ELASTICYOLO_ETCD_PASSWORD_FILE": str(wrong)}),
                     "authentication as 'elasticyolo' failed")
    assert "invalid user ID or password" in line and "not-the-password" not in line
    no_user = {k: v for k, v in env.items() if k not in ("ELASTICYOLO_ETCD_USER", "ELASTICYOLO_ETCD_PASSWORD_FILE")}
    _one_line(_cli("status", "--etcd", ep, "--job", "x", env=no_user), "authentication is on and no user is configured")
    # the agent refuses the same way at start (exit 2, one line), before registering anything
    r = _cli("agent", "--etcd", ep, "--job", "x", "--startup-timeout-s", "5", "--etcd-password-file", str(wrong), env=env)
    _one_line(r, "authentication as 'elasticyolo' failed")
    # the role reaches /elasticyolo/ only
    with pytest.raises(EtcdError, match="permission denied for user 'elasticyolo'"):
        secure.client().put("/not-elasticyolo/x", "y")


def _leak_check(texts: dict[str, str | bytes], needles: list[str]) -> list[str]:
    found = []
    for where, text in texts.items():
        data = text.encode() if isinstance(text, str) else text
        for n in needles:
            if n.encode() in data:
                found.append(f"{n[:12]}... in {where}")
    return found


def test_agents_train_through_tls_auth_etcd_with_s3_dataset_and_sse(
        secure: Secure, s3_server: S3Server, job_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3")
    bucket = f"prod-{job_name}"[:60].rstrip("-")
    s3.create_bucket(Bucket=bucket)
    ds = write_dataset(tmp_path / "shapes", SynthSpec(train=24, val=6, imgsz=64)).parent
    upload_dataset(ds, f"s3://{bucket}/shapes", {})

    etcd = secure.cluster
    leader = etcd.leader_member()
    assert leader is not None
    # Clients use the raft leader first: killing it costs both a failover and an election.
    endpoints = ",".join(m.endpoint for m in [leader] + [m for m in etcd.members if m is not leader])
    creds = tmp_path / "credentials"  # as systemd's LoadCredential=etcd-password:... gives it
    creds.mkdir()
    (creds / "etcd-password").write_text(secure.password + "\n")
    (creds / "etcd-password").chmod(0o400)
    env = {**secure.env(), "CREDENTIALS_DIRECTORY": str(creds), "OMP_NUM_THREADS": "1",
           "ELASTICYOLO_SNAPSHOT_S": "2"}
    # ttl 5: TLS handshakes on two loaded cores must not cost a lease (the member loss is the test)
    cluster = AgentCluster(endpoints, job_name, tmp_path, ttl=5, env=env, client=secure.client(endpoints))
    proxy = S3FaultProxy(s3_server.port, get_delay_s=0.1).start()  # node b's S3 path: slow, so staging shows
    violations: list[str] = []
    stop = threading.Event()
    ps_snapshots: dict[str, str | bytes] = {}
    after: list[dict[str, Any]] = []
    try:
        # node a: the password from a file; node b: from the systemd credential
        cluster.start("a", "--etcd-password-file", str(secure.password_file), "--data-cache-dir", str(tmp_path / "cache-a"))
        cluster.wait(lambda: cluster.ready(["a"]), 60, "node a")
        cluster.submit(f"data=s3://{bucket}/shapes/data.yaml", "model=yolov8n.yaml", "epochs=60", "imgsz=64", "batch=4",
                       "engine=horovod", "min_nodes=1", "max_nodes=2", f"checkpoint=s3://{bucket}/ckpt",
                       "save_period_steps=4", "s3_sse=aws:kms", f"s3_kms_key_id={KMS_KEY}")
        cluster.wait(lambda: cluster.steps(world=1), 180, "training at world 1")

        def watch_join() -> None:
            """Node b must never hold a rank while its dataset is not staged."""
            while not stop.is_set():
                try:
                    ranks = cluster.world().get("ranks") or {}
                    rec = cluster.nodes().get("b") or {}
                    data = rec.get("data") or {}
                    if "b" in ranks and data.get("state") != "ready":
                        violations.append(f"b holds ranks {ranks['b']} with data {data}")
                except Exception:  # noqa: BLE001 - etcd may be electing
                    pass
                stop.wait(0.05)

        threading.Thread(target=watch_join, daemon=True).start()
        b_started = time.time()
        cluster.start("b", "--data-cache-dir", str(tmp_path / "cache-b"), "--s3-endpoint-url", proxy.endpoint_url,
                      "--data-max-concurrency", "2")
        staging = cluster.wait(lambda: (cluster.nodes().get("b") or {}).get("data", {}).get("state") == "staging",
                               60, "node b staging its dataset")
        assert staging
        cluster.wait(lambda: len({e["pid"] for e in cluster.steps(world=2)}) == 2, 180,
                     "both workers training at world 2")
        first2 = cluster.steps(world=2)
        join_s = min(e["t"] for e in first2) - b_started
        b_data = cluster.nodes()["b"]["data"]
        assert b_data["state"] == "ready" and b_data["downloaded_files"] == b_data["files"] > 0
        assert join_s > b_data["seconds"], (join_s, b_data)  # staging is part of b's join time
        table = cluster.status(as_json=False)
        assert "DATA" in table and "ready" in table

        # secrets while everything runs: process tables with their environments
        procs = [p for a in cluster.agents.values() if a.proc for p in
                 [psutil.Process(a.proc.pid), *psutil.Process(a.proc.pid).children(recursive=True)]]
        ps_snapshots["ps auxwwe"] = subprocess.run(["ps", "auxwwe"], capture_output=True, text=True).stdout
        for p in procs:
            try:
                ps_snapshots[f"/proc/{p.pid}/cmdline"] = Path(f"/proc/{p.pid}/cmdline").read_bytes()
                ps_snapshots[f"/proc/{p.pid}/environ"] = Path(f"/proc/{p.pid}/environ").read_bytes()
            except OSError:
                pass
        assert len(procs) >= 4  # two agents, their workers (and data loaders)

        # kill the raft leader, which every client is using, mid-training
        workers_before = {e["pid"] for e in cluster.events() if e["ev"] == "step" and e["world"] == 2}
        killed_at_step = max(e["step"] for e in cluster.steps(world=2))
        kill_time = time.time()
        etcd.kill_member(leader)
        probe = secure.client(endpoints)  # a client on the dead member first: failover + election
        probe.put(cluster.keys.prefix + "probe", "after the kill")
        failover_s = time.time() - kill_time
        cluster.wait(lambda: [e for e in cluster.steps(world=2) if e["step"] >= killed_at_step + 6], 120,
                     "training to go on after the etcd leader was killed")
        cluster.wait(lambda: _landed_after(cluster, killed_at_step), 120, "a checkpoint after the member loss")
        after = [e for e in cluster.events() if e.get("t", 0) > kill_time]
        stop.set()  # (a cancelled job leaves its last world behind)
        _cancel(cluster)
    finally:
        stop.set()
        cluster.stop()
        for m in etcd.members:
            if not m.alive:
                etcd.start_member(m)
    assert not violations, violations[:3]

    # a member loss costs at most one retry: no Horovod reset, the same workers training at world
    # 2 throughout, and at most one failed etcd operation per agent that names the dead member
    assert not [e for e in after if e["ev"] == "reset"], "the member loss reset the world"
    assert {e["world"] for e in after if e["ev"] == "step"} == {2}
    assert {e["pid"] for e in after if e["ev"] == "step"} <= workers_before
    dead = f":{leader.client_port}"
    retried = {}
    for node in ("a", "b"):
        retries = [r for r in cluster.logs(node) if r.get("level") in ("warning", "error") and dead in json.dumps(r)
                   and _epoch(r.get("timestamp", "1970-01-01T00:00:00Z")) >= kill_time]
        assert len(retries) <= 1, [(r.get("event"), r.get("error")) for r in retries]
        retried[node] = len(retries)

    # checkpoints: every object SSE-KMS with the job's key, checked on the server side
    objects = s3.list_objects_v2(Bucket=bucket, Prefix="ckpt/")["Contents"]
    assert any(o["Key"].endswith(".pt") for o in objects) and any("/manifests/" in o["Key"] for o in objects)
    for o in objects:
        head = s3.head_object(Bucket=bucket, Key=o["Key"])
        assert head.get("ServerSideEncryption") == "aws:kms" and head.get("SSEKMSKeyId") == KMS_KEY, o["Key"]

    # no password or key material: logs (agents, workers, etcd), ps, etcd values, checkpoints
    texts: dict[str, str | bytes] = dict(ps_snapshots)
    for f in list(tmp_path.glob("*.log")) + list(etcd.root.glob("*.log")):
        texts[str(f)] = f.read_bytes()
    for key, value, _ in secure.client().get_prefix(f"/elasticyolo/{job_name}/"):
        texts[f"etcd {key}"] = value
    for o in objects:
        texts[f"s3 {o['Key']}"] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    assert len(texts) > 10
    leaks = _leak_check(texts, [secure.password, *secure.key_material()])
    assert not leaks, leaks[:5]

    # a second job on the same nodes reuses their staged copies
    (tmp_path / "second").mkdir()
    cluster2 = AgentCluster(endpoints, job_name, tmp_path / "second", ttl=5, env=env, client=secure.client(endpoints))
    try:
        cluster2.start("a", "--data-cache-dir", str(tmp_path / "cache-a"))
        cluster2.start("b", "--data-cache-dir", str(tmp_path / "cache-b"), "--s3-endpoint-url", proxy.endpoint_url)
        cluster2.wait(lambda: cluster2.ready(["a", "b"]), 60, "both nodes again")
        cluster2.submit("--replace", f"data=s3://{bucket}/shapes/data.yaml", "model=yolov8n.yaml", "epochs=1",
                        "imgsz=64", "batch=4", "engine=horovod", "min_nodes=2")

        def reused() -> dict[str, Any] | None:
            data = {n: (r.get("data") or {}) for n, r in cluster2.nodes().items()}
            return data if len(data) == 2 and all(d.get("state") == "ready" for d in data.values()) else None

        data = cluster2.wait(reused, 120, "both nodes' datasets ready")
        assert all(d["reused"] and d["downloaded_files"] == 0 for d in data.values()), data
        _cancel(cluster2)
    finally:
        cluster2.stop()
        proxy.stop()
    second = ", ".join(f"{n} {d['seconds']:.2f}s" for n, d in sorted(data.items()))
    print(f"\nnode b: staging {b_data['seconds']:.2f}s ({b_data['files']} files), join (agent start -> first step "
          f"at world 2) {join_s:.2f}s; second job reused the copies: {second}; etcd leader killed: first write "
          f"{failover_s:.2f}s later, failed agent operations naming it {retried}, resets 0")


def _landed_after(cluster: AgentCluster, step: int) -> bool:
    got = cluster.client.get(cluster.keys.checkpoint_latest)
    return bool(got) and int(json.loads(got[0]).get("step", -1)) > step


def _cancel(cluster: AgentCluster) -> None:
    r = subprocess.run([ELASTICYOLO, "cancel", "--etcd", cluster.endpoints, "--job", cluster.job],
                       capture_output=True, text=True, timeout=30, env={**os.environ, **cluster.env})
    assert r.returncode == 0, r.stderr
    cluster.wait(lambda: all(n.get("state") == "IDLE" for n in cluster.nodes().values()), 60, "nodes idle after cancel")


def _epoch(ts: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()
