"""TLS (CA + client certificate) and user/password auth against real etcd servers on 127.0.0.1."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest
import requests

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.errors import UnavailableError, UserError
from elasticyolo.testing.servers import EtcdCluster

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca-key.pem", "-out", "ca.pem",
             "-days", "2", "-subj", "/CN=elasticyolo-test-ca", cwd=d)
    (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}-key.pem", "-out", f"{name}.csr",
                 "-subj", f"/CN={name}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca-key.pem", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", "san.cnf", cwd=d)
    return d


@pytest.fixture
def tls_etcd(certs: Path) -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(size=1)
    m = cluster.members[0]
    cmd = cluster._cmd(m, "new")
    for flag in ("--listen-client-urls", "--advertise-client-urls"):
        cmd[cmd.index(flag) + 1] = f"https://127.0.0.1:{m.client_port}"
    cmd += ["--cert-file", str(certs / "server.pem"), "--key-file", str(certs / "server-key.pem"),
            "--trusted-ca-file", str(certs / "ca.pem"), "--client-cert-auth",
            # etcd 3.4's Go TLS and OpenSSL 3 clients can fail TLS 1.3 handshakes ("bad record MAC")
            "--cipher-suites", "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384"]
    log = open(m.log_path, "ab")
    m.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    log.close()
    try:
        s = requests.Session()
        s.verify, s.cert = str(certs / "ca.pem"), (str(certs / "client.pem"), str(certs / "client-key.pem"))
        deadline_ok = False
        for _ in range(200):
            try:
                deadline_ok = s.get(f"https://{m.endpoint}/health", timeout=1, verify=s.verify).status_code == 200
                if deadline_ok:
                    break
            except requests.RequestException:
                pass
            if m.proc.poll() is not None:
                break
            import time

            time.sleep(0.05)
        assert deadline_ok, m.log_path.read_text()[-2000:]
        yield cluster
    finally:
        cluster.stop()


def test_tls_with_client_certificate(tls_etcd: EtcdCluster, certs: Path) -> None:
    ep = tls_etcd.endpoints
    e = EtcdClient(ep, ca_cert=str(certs / "ca.pem"), cert_cert=str(certs / "client.pem"),
                   cert_key=str(certs / "client-key.pem"))
    assert e.endpoints == [f"https://{ep}"]
    e.put("/elasticyolo/tls/k", "v")
    assert e.get("/elasticyolo/tls/k")[0] == b"v"  # type: ignore[index]
    # without the client certificate the server refuses the handshake: reported as unreachable
    with pytest.raises(UnavailableError):
        EtcdClient(ep, ca_cert=str(certs / "ca.pem"), timeout=0.5, retry_window=0.3).get("/elasticyolo/tls/k")


@pytest.fixture
def auth_etcd() -> Iterator[EtcdCluster]:
    with EtcdCluster(size=1) as cluster:
        base = f"http://{cluster.endpoints}/v3"
        for path, body in (("/auth/user/add", {"name": "root", "password": "rootpw"}),
                           ("/auth/role/add", {"name": "root"}),
                           ("/auth/user/grant", {"user": "root", "role": "root"}),
                           ("/auth/enable", {})):
            r = requests.post(base + path, json=body, timeout=5)
            assert r.status_code == 200, (path, r.text)
        yield cluster


def test_user_password_auth(auth_etcd: EtcdCluster) -> None:
    ep = auth_etcd.endpoints
    e = EtcdClient(ep, user="root", password="rootpw")
    e.put("/elasticyolo/auth/k", "v")
    assert e.get("/elasticyolo/auth/k")[0] == b"v"  # type: ignore[index]
    lease = e.lease_grant(5)
    assert e.lease_refresh(lease) == 5
    with pytest.raises(UserError, match="authentication as 'root' failed"):
        EtcdClient(ep, user="root", password="wrong").get("/elasticyolo/auth/k")
    with pytest.raises(Exception) as err:  # no credentials at all: refused, not retried forever
        EtcdClient(ep, retry_window=0.5).get("/elasticyolo/auth/k")
    assert "user name is empty" in str(err.value) or "permission" in str(err.value).lower() or "token" in str(err.value)
