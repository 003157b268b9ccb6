"""Shared fixtures: real servers on 127.0.0.1, and the offline/loopback-only environment."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.agents import AgentProcess
from elasticyolo.local_cluster.metadata_server import MetadataServer
from elasticyolo.local_cluster.servers import EtcdCluster, S3Server

REPO = Path(__file__).resolve().parents[1]

# Keep every child process (torch, gloo, horovod) on loopback and offline.
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("HOROVOD_GLOO_IFACE", "lo")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("ELASTICYOLO_LOG_FORMAT", "json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked `ray_in_process` run last (in their own order): Ray's driver and its local
    cluster leave Ray's native threads in this process, and a process with threads must not fork
    (`test_zygote` forks this process, as the torch launcher forks its zygote)."""
    items.sort(key=lambda item: item.get_closest_marker("ray_in_process") is not None)


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdCluster]:
    """One etcd member on loopback, shared by the session (tests use distinct job names)."""
    with EtcdCluster(size=1) as cluster:
        yield cluster


@pytest.fixture
def etcd_cluster3() -> Iterator[EtcdCluster]:
    """A fresh 3-member etcd cluster on loopback (for member-failure tests)."""
    with EtcdCluster(size=3) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    with S3Server() as server:
        yield server


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """The session's S3 server, with boto3's endpoint and credentials in this test's environment."""
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    return s3_server


@pytest.fixture
def job_name(request: pytest.FixtureRequest) -> str:
    """A job name unique to the test, so tests can share one etcd."""
    return "t-" + request.node.name.replace("[", "-").replace("]", "").replace("_", "-")[:40].lower()


@pytest.fixture
def md() -> Iterator[MetadataServer]:
    """A local cloud-metadata server (AWS, GCP, Azure APIs) on 127.0.0.1."""
    with MetadataServer() as server:
        yield server


@pytest.fixture
def cluster(etcd_server: EtcdCluster, job_name: str, tmp_path: Path) -> Iterator[AgentCluster]:
    """Local agents for one job on the shared etcd, stopped (workers too) after the test."""
    c = AgentCluster(etcd_server.endpoints, job_name, tmp_path,
                     env={"OMP_NUM_THREADS": "1", "ELASTICYOLO_SNAPSHOT_S": "2"})
    yield c
    c.stop()


@pytest.fixture
def agents() -> Iterator[list[AgentProcess]]:
    """Agent processes a test starts (append them); all stopped at the end."""
    started: list[AgentProcess] = []
    yield started
    for a in started:
        a.stop()
