"""Start real etcd and S3 API (moto) servers on 127.0.0.1 for tests, benchmarks and the demo.

Everything binds to loopback; data lives in a temp dir that goes away with the server.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, ok=(200,)) -> None:  # type: ignore[type-arg]
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status in ok:
                    return
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s ({last})")


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    """One or more etcd members on loopback (`etcd` from Debian's etcd-server)."""

    size: int = 1
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="elasticyolo-etcd-")))
    members: list[EtcdMember] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.members:
            for i in range(self.size):
                name = f"m{i}"
                self.members.append(
                    EtcdMember(name, free_port(), free_port(), self.root / name, self.root / f"{name}.log")
                )

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def _cmd(self, m: EtcdMember, state: str) -> list[str]:
        initial = ",".join(f"{o.name}=http://127.0.0.1:{o.peer_port}" for o in self.members)
        return [
            shutil.which("etcd") or "/usr/bin/etcd",
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", f"http://127.0.0.1:{m.client_port}",
            "--advertise-client-urls", f"http://127.0.0.1:{m.client_port}",
            "--listen-peer-urls", f"http://127.0.0.1:{m.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{m.peer_port}",
            "--initial-cluster", initial,
            "--initial-cluster-state", state,
            "--initial-cluster-token", self.root.name,
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        for m in self.members:
            self.start_member(m, wait=False)
        for m in self.members:
            _wait_http(f"http://{m.endpoint}/health", timeout, m.proc)
        return self

    def start_member(self, m: EtcdMember, wait: bool = True, timeout: float = 30.0) -> None:
        state = "existing" if m.data_dir.exists() else "new"
        log = open(m.log_path, "ab")
        m.proc = subprocess.Popen(self._cmd(m, state), stdout=log, stderr=log, stdin=subprocess.DEVNULL)
        log.close()
        if wait:
            _wait_http(f"http://{m.endpoint}/health", timeout, m.proc)

    def kill_member(self, m: EtcdMember) -> None:
        if m.proc is not None and m.proc.poll() is None:
            m.proc.send_signal(signal.SIGKILL)
            m.proc.wait(10)

    def stop(self) -> None:
        for m in self.members:
            if m.proc is not None and m.proc.poll() is None:
                m.proc.terminate()
                try:
                    m.proc.wait(10)
                except subprocess.TimeoutExpired:
                    m.proc.kill()
                    m.proc.wait(10)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class S3Server:
    """moto's standalone server: a real S3 HTTP API on 127.0.0.1."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="moto-", suffix=".log")[1]))

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """Environment for a boto3 client (or a child process) that talks to this server."""
        return {
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def start(self, timeout: float = 30.0) -> "S3Server":
        exe = Path(sys.executable).with_name("moto_server")
        cmd = [str(exe) if exe.exists() else "moto_server", "-H", "127.0.0.1", "-p", str(self.port)]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true"})
        log.close()
        _wait_http(f"{self.endpoint_url}/moto-api/", timeout, self.proc)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
