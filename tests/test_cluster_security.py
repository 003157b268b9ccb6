"""TLS (CA + client certificate) and user/password auth against real etcd servers on 127.0.0.1."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterator

import pytest
import requests

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.errors import UserError
from elasticyolo.local_cluster.servers import EtcdCluster, EtcdPki

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl not installed")


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> EtcdPki:
    """Certificates from deploy/etcd/make-certs.sh."""
    return EtcdPki.generate(tmp_path_factory.mktemp("pki"), ["m0"])


@pytest.fixture
def tls_etcd(pki: EtcdPki) -> Iterator[EtcdCluster]:
    """One member configured from deploy/etcd/etcd.conf.yml.template (client certs required)."""
    with EtcdCluster(size=1, tls=pki) as cluster:
        yield cluster


def test_tls_with_client_certificate(tls_etcd: EtcdCluster, pki: EtcdPki, tmp_path: Path) -> None:
    ep = tls_etcd.endpoints
    e = EtcdClient(ep, **pki.client_kwargs())
    assert e.endpoints == [f"https://{ep}"]
    e.put("/elasticyolo/tls/k", "v")
    assert e.get("/elasticyolo/tls/k")[0] == b"v"  # type: ignore[index]
    # without the client certificate the server refuses the handshake: one clear line, no retries
    with pytest.raises(UserError, match="TLS handshake refused .*requires a client certificate"):
        EtcdClient(ep, ca_cert=pki.ca, timeout=5.0).get("/elasticyolo/tls/k")  # 0.5 s timed out on a loaded host
    other = EtcdPki.generate(tmp_path / "other", ["m0"])
    with pytest.raises(UserError, match="does not accept our client certificate"):
        EtcdClient(ep, ca_cert=pki.ca, cert_cert=other.client()[0], cert_key=other.client()[1]).get("/elasticyolo/x")
    with pytest.raises(UserError, match="certificate is not trusted .*set etcd_ca"):
        EtcdClient(ep, ca_cert=other.ca, cert_cert=pki.client()[0], cert_key=pki.client()[1]).get("/elasticyolo/x")


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
    # no credentials at all: refused at once with what to set, not retried forever
    with pytest.raises(UserError, match="authentication is on and no user is configured: set etcd_user"):
        EtcdClient(ep, retry_window=0.5).get("/elasticyolo/auth/k")
