"""Start real etcd and S3 API (moto) servers on 127.0.0.1 for tests, benchmarks and the demo.

Everything binds to loopback; data lives in a temp dir that goes away with the server.
`EtcdCluster(host=..., exec_prefix=["ip", "netns", "exec", NS])` runs the members on that address
inside a network namespace instead (partition tests, `tests/support/netns.py`).
`EtcdCluster(tls=EtcdPki.generate(...))` runs the production setup from deploy/etcd: certificates
from `make-certs.sh`, members configured from `etcd.conf.yml.template` (TLS for clients and
peers, client certificates required, JWT tokens), and `enable_auth()` runs `setup-auth.sh`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import string
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Collection

from elasticyolo.errors import UserError
from elasticyolo.priority import ETCD_NICE, priority_prefix

DEPLOY_ETCD = Path(__file__).resolve().parents[2] / "deploy" / "etcd"


def free_port() -> int:
    return free_ports(1)[0]


def free_ports(n: int, avoid: Collection[int] = ()) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now, none of them in `avoid` (ports handed out before
    whose servers may not have bound them yet)."""
    held: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(s)
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
            if port not in avoid:
                ports.append(port)
        return ports
    finally:
        for s in held:
            s.close()


def etcd_binary() -> str:
    """The `etcd` executable; a one-line UserError when it is missing."""
    found = shutil.which("etcd") or ("/usr/bin/etcd" if Path("/usr/bin/etcd").exists() else None)
    if found is None:
        raise UserError("etcd not found on PATH: the local cluster needs etcd (Debian: apt-get install "
                        "etcd-server, or make setup)")
    return found


def _wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None, ok=(200,),  # type: ignore[type-arg]
               context: ssl.SSLContext | None = None) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=1, context=context) as resp:
                if resp.status in ok:
                    return
        except Exception as exc:  # noqa: BLE001 - any failure means "not yet"
            last = exc
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s ({last})")


def _wait_http_via(prefix: list[str], url: str, timeout: float, proc: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """`_wait_http` run through `prefix` (inside a network namespace: only from there is `url` reachable)."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from elasticyolo.local_cluster.servers import _wait_http;"
            " _wait_http(sys.argv[2], float(sys.argv[3]))")
    root = str(Path(__file__).resolve().parents[2])
    r = subprocess.run([*prefix, sys.executable, "-c", code, root, url, str(timeout)], capture_output=True,
                       text=True, timeout=timeout + 30)
    if proc.poll() is not None:
        raise RuntimeError(f"server exited with {proc.returncode} before {url} answered")
    if r.returncode != 0:
        raise TimeoutError(f"{url} did not answer within {timeout}s: {r.stderr.strip()[-300:]}")


@dataclass(frozen=True)
class EtcdPki:
    """Certificates made by deploy/etcd/make-certs.sh: CA, one cert per member, client certs
    (`client-agent`: CN elasticyolo-agent; `client-root`: CN root, etcd's admin by certificate)."""

    dir: Path

    @classmethod
    def generate(cls, out: Path, members: list[str], addrs: str = "127.0.0.1,localhost") -> "EtcdPki":
        subprocess.run(["bash", str(DEPLOY_ETCD / "make-certs.sh"), str(out), *(f"{m}={addrs}" for m in members)],
                       check=True, capture_output=True, timeout=120)
        return cls(out)

    @property
    def ca(self) -> str:
        return str(self.dir / "ca.pem")

    def client(self, name: str = "agent") -> tuple[str, str]:
        return str(self.dir / f"client-{name}.pem"), str(self.dir / f"client-{name}-key.pem")

    def client_kwargs(self, name: str = "agent") -> dict[str, str]:
        """EtcdClient TLS arguments for a client certificate."""
        cert, key = self.client(name)
        return {"ca_cert": self.ca, "cert_cert": cert, "cert_key": key}

    def ssl_context(self, name: str = "agent") -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        ctx.load_cert_chain(*self.client(name))
        return ctx


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log_path: Path
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]
    host: str = "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.client_port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class EtcdCluster:
    """One or more etcd members on loopback (`etcd` from Debian's etcd-server)."""

    size: int = 1
    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="elasticyolo-etcd-")))
    members: list[EtcdMember] = field(default_factory=list)
    # TLS for clients and peers with client certificates required (deploy/etcd's setup); the
    # member names must be among the certificates' members.
    tls: EtcdPki | None = None
    auth_user: str | None = None  # set by enable_auth()
    host: str = "127.0.0.1"  # the members' address
    # Run the members (and their health checks) through this, e.g. `ip netns exec NS`: a member in
    # a namespace is reachable only from there. (Its ports are then free whatever free_port saw.)
    exec_prefix: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.members:
            for i in range(self.size):
                name = f"m{i}"
                self.members.append(
                    EtcdMember(name, free_port(), free_port(), self.root / name, self.root / f"{name}.log",
                               host=self.host)
                )

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint_urls(self) -> str:
        return ",".join(f"{self.scheme}://{m.endpoint}" for m in self.members)

    def client_kwargs(self) -> dict[str, Any]:
        """TLS arguments for `EtcdClient` (empty without TLS)."""
        return self.tls.client_kwargs() if self.tls else {}

    def _cmd(self, m: EtcdMember, state: str) -> list[str]:
        if self.tls is not None:
            return [*self.exec_prefix, etcd_binary(), "--config-file",
                    str(self._render_config(m, state))]
        initial = ",".join(f"{o.name}=http://{o.host}:{o.peer_port}" for o in self.members)
        return [
            *self.exec_prefix,
            etcd_binary(),
            "--name", m.name,
            "--data-dir", str(m.data_dir),
            "--listen-client-urls", f"http://{m.host}:{m.client_port}",
            "--advertise-client-urls", f"http://{m.host}:{m.client_port}",
            "--listen-peer-urls", f"http://{m.host}:{m.peer_port}",
            "--initial-advertise-peer-urls", f"http://{m.host}:{m.peer_port}",
            "--initial-cluster", initial,
            "--initial-cluster-state", state,
            "--initial-cluster-token", self.root.name,
            "--heartbeat-interval", "50",
            "--election-timeout", "500",
            "--logger", "zap",
            "--log-outputs", "stderr",
        ]

    def _render_config(self, m: EtcdMember, state: str) -> Path:
        """deploy/etcd/etcd.conf.yml.template filled in for one member (as envsubst would)."""
        assert self.tls is not None
        template = string.Template((DEPLOY_ETCD / "etcd.conf.yml.template").read_text())
        text = template.substitute(
            ETCD_NAME=m.name, ETCD_DATA_DIR=str(m.data_dir), ETCD_IP=m.host,
            ETCD_CLIENT_PORT=m.client_port, ETCD_PEER_PORT=m.peer_port,
            ETCD_INITIAL_CLUSTER=",".join(f"{o.name}=https://{o.host}:{o.peer_port}" for o in self.members),
            ETCD_CLUSTER_TOKEN=self.root.name, ETCD_PKI=str(self.tls.dir), ETCD_HEARTBEAT_MS=50, ETCD_ELECTION_MS=500,
        ).replace("initial-cluster-state: new", f"initial-cluster-state: {state}")
        path = self.root / f"{m.name}.conf.yml"
        path.write_text(text)
        return path

    def _wait_healthy(self, m: EtcdMember, timeout: float) -> None:
        if self.exec_prefix:
            _wait_http_via(self.exec_prefix, f"{self.scheme}://{m.endpoint}/health", timeout, m.proc)
            return
        ctx = self.tls.ssl_context() if self.tls else None
        _wait_http(f"{self.scheme}://{m.endpoint}/health", timeout, m.proc, context=ctx)

    def start(self, timeout: float = 30.0) -> "EtcdCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        for m in self.members:
            self.start_member(m, wait=False)
        for m in self.members:
            self._wait_healthy(m, timeout)
        return self

    def enable_auth(self, password_file: Path, user: str = "elasticyolo") -> None:
        """deploy/etcd/setup-auth.sh: root by admin certificate only, `user` with a role limited
        to /elasticyolo/, auth on. Needs TLS (the admin is identified by its certificate)."""
        assert self.tls is not None, "enable_auth needs a TLS cluster"
        r = subprocess.run(["bash", str(DEPLOY_ETCD / "setup-auth.sh"), self.endpoint_urls, str(self.tls.dir),
                            str(password_file), user], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"setup-auth.sh failed: {r.stderr.strip() or r.stdout.strip()}")
        self.auth_user = user

    def leader_member(self) -> EtcdMember | None:
        """The member that is the raft leader now (from each member's /v3/maintenance/status)."""
        import json

        ctx = self.tls.ssl_context() if self.tls else None
        for m in self.members:
            if not m.alive:
                continue
            req = urllib.request.Request(f"{self.scheme}://{m.endpoint}/v3/maintenance/status", data=b"{}",
                                         method="POST")
            try:
                with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
                    st = json.loads(resp.read())
            except Exception:  # noqa: BLE001 - a member that does not answer is not the leader
                continue
            if st.get("leader") and st.get("leader") == st.get("header", {}).get("member_id"):
                return m
        return None

    def start_member(self, m: EtcdMember, wait: bool = True, timeout: float = 30.0) -> None:
        state = "existing" if m.data_dir.exists() else "new"
        log = open(m.log_path, "ab")
        # At etcd's production priority (priority.py): a starved etcd lets every lease lapse at once.
        m.proc = subprocess.Popen(priority_prefix(ETCD_NICE) + self._cmd(m, state), stdout=log, stderr=log,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        if wait:
            self._wait_healthy(m, timeout)

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


MOTO_OBJECT_BUFFER = 1 << 30
# The extra that installs moto: the local S3 server (the demo, chaos replays) is product code, moto
# an optional dependency of it.
MOTO_EXTRA = "elasticyolo[demo]"


def moto_server() -> str:
    """The `moto_server` executable (next to this Python, else on PATH); a one-line UserError
    naming the extra to install when moto is missing."""
    exe = Path(sys.executable).with_name("moto_server")
    found = str(exe) if exe.exists() else shutil.which("moto_server")
    if found is None:
        raise UserError(f"moto_server not found: the local S3 API server needs moto[server] "
                        f"(pip install '{MOTO_EXTRA}', or make setup)")
    return found


@dataclass
class S3Server:
    """moto's standalone server: a real S3 HTTP API on 127.0.0.1."""

    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]
    # A temp file of its own, removed by `stop` unless the server failed to start (then the
    # error names it).
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
        try:
            cmd = [moto_server(), "-H", "127.0.0.1", "-p", str(self.port)]
        except UserError:
            self.stop()  # its log file
            raise
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                     env={**os.environ, "MOTO_ALLOW_NONEXISTENT_REGION": "true",
                                          # Objects stay in memory: moto otherwise spools each one over
                                          # 5 MB to a temp file, disk and CPU that a real S3 spends on
                                          # another machine, not on the training node under test.
                                          "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(MOTO_OBJECT_BUFFER)})
        log.close()
        try:
            _wait_http(f"{self.endpoint_url}/moto-api/", timeout, self.proc)
        except (RuntimeError, TimeoutError) as exc:
            self.stop(keep_log=True)
            raise type(exc)(f"{exc}; moto_server's log: {self.log_path}") from exc
        return self

    def stop(self, keep_log: bool = False) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if not keep_log:
            self.log_path.unlink(missing_ok=True)

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
