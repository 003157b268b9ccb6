"""CLI failure modes (one clear line, non-zero exit, nothing written), systemd notify, the unit file."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from elasticyolo.agent.sd_notify import SystemdNotifier
from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.local_cluster.agents import ELASTICYOLO, AgentProcess
from elasticyolo.local_cluster.servers import EtcdCluster, free_port
from elasticyolo.local_cluster.wait import wait_for

REPO = Path(__file__).resolve().parents[1]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ELASTICYOLO, *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "ELASTICYOLO_LOG_FORMAT": "json", **(env or {})})


def assert_one_error_line(r: subprocess.CompletedProcess[str], code: int, needle: str) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("elasticyolo ") and ": error: " in lines[0] and needle in lines[0], lines[0]


def nothing_written(etcd: EtcdCluster, job: str) -> bool:
    return EtcdClient(etcd.endpoints).get_prefix(JobKeys(job).prefix) == []


def test_agent_bad_config_one_line(etcd_server: EtcdCluster, job_name: str, tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"etcd: [{etcd_server.endpoints}]\njob: {job_name}\nttl: -3\n")
    r = run_cli("agent", "--config", str(cfg))
    assert_one_error_line(r, 2, "ttl: Input should be greater than or equal to 1")
    r = run_cli("agent", "--config", str(cfg), "--ttl", "2", env={"ELASTICYOLO_SLOTS": "x"})
    assert_one_error_line(r, 2, "slots: Input should be a valid integer")
    r = run_cli("agent", "--config", str(tmp_path / "missing.yaml"))
    assert_one_error_line(r, 2, "not found")
    assert nothing_written(etcd_server, job_name)


def test_agent_bad_job_spec_in_config(etcd_server: EtcdCluster, job_name: str, tmp_path: Path) -> None:
    cfg = tmp_path / "agent.yaml"
    cfg.write_text(f"etcd: [{etcd_server.endpoints}]\njob: {job_name}\nspec:\n  data: d.yaml\n  engine: mpi\n")
    r = run_cli("agent", "--config", str(cfg))
    assert_one_error_line(r, 2, "spec: engine: Input should be 'horovod', 'torch' or 'ray'")
    assert nothing_written(etcd_server, job_name)


def test_agent_unreachable_etcd(job_name: str) -> None:
    dead = f"127.0.0.1:{free_port()}"
    r = run_cli("agent", "--config", os.devnull, "--etcd", dead, "--job", job_name, "--startup-timeout-s", "0.5")
    assert_one_error_line(r, 3, f"etcd unreachable at http://{dead}")


def test_submit_and_status_errors(etcd_server: EtcdCluster, job_name: str) -> None:
    ep = etcd_server.endpoints
    r = run_cli("submit", "--etcd", ep, "--job", job_name, "data=d.yaml", "epochs=zero")
    assert_one_error_line(r, 2, "epochs: Input should be a valid integer")
    r = run_cli("submit", "--etcd", ep, "--job", job_name, "data=d.yaml", "colour=red")
    assert_one_error_line(r, 2, "unknown option 'colour'")
    r = run_cli("submit", "--etcd", ep, "--job", job_name, "epochs=3")
    assert_one_error_line(r, 2, "data: Field required")
    r = run_cli("submit", "--etcd", ep, "--job", "Bad Name", "data=d.yaml")
    assert_one_error_line(r, 2, "job name 'Bad Name' is invalid")
    r = run_cli("submit", "--etcd", ep, "--job", job_name, "data=d.yaml", "resume=true")
    assert_one_error_line(r, 2, "a cluster job resumes by itself from its checkpoint store")
    r = run_cli("cancel", "--etcd", ep, "--job", job_name)
    assert_one_error_line(r, 2, "has no spec")
    assert nothing_written(etcd_server, job_name)
    dead = f"127.0.0.1:{free_port()}"
    for cmd in (["status"], ["submit", "data=d.yaml"], ["cancel"]):
        r = run_cli(cmd[0], "--etcd", dead, "--etcd-timeout", "0.3", "--job", job_name, *cmd[1:])
        assert_one_error_line(r, 3, "etcd unreachable")
    r = run_cli("status", "--job", job_name, env={"ELASTICYOLO_ETCD": "", "ELASTICYOLO_CONFIG": os.devnull})
    assert_one_error_line(r, 2, "no etcd endpoints")


def test_sd_notify_protocol(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        n = SystemdNotifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
        assert n.enabled and n.watchdog_s == 2.0
        assert n.ready("IDLE")
        assert server.recv(4096) == b"READY=1\nSTATUS=IDLE"
        assert n.watchdog()
        assert server.recv(4096) == b"WATCHDOG=1"
    off = SystemdNotifier({})
    assert not off.enabled and off.ready() is False and off.watchdog_s is None
    assert SystemdNotifier({"WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"}).watchdog_s is None  # not for us


def test_agent_under_notify_socket(etcd_server: EtcdCluster, job_name: str, tmp_path: Path) -> None:
    path = str(tmp_path / "n.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(path)
        server.settimeout(10)
        a = AgentProcess(etcd_server.endpoints, job_name, "sd1", log_dir=tmp_path,
                         env={"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "1500000"}).start()
        try:
            got: list[str] = []

            def saw(prefix: str) -> bool:
                while not any(m.startswith(prefix) for m in got):
                    got.extend(server.recv(4096).decode().split("\n"))
                return True

            assert saw("READY=1") and saw("STATUS=IDLE") and saw("WATCHDOG=1")
            a.signal(signal.SIGTERM)
            assert saw("STOPPING=1")
            assert a.proc is not None and a.proc.wait(10) == 0
        finally:
            a.stop()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_unit_verifies(tmp_path: Path) -> None:
    text = (REPO / "systemd" / "elasticyolo-agent.service").read_text()
    for needle in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "TimeoutStopSec=", "KillMode=mixed"):
        assert needle in text
    # verify needs ExecStart to exist: point it at this checkout's venv
    unit = tmp_path / "elasticyolo-agent.service"
    unit.write_text(text.replace("/opt/elasticyolo/.venv/bin/elasticyolo", ELASTICYOLO))
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    problems = [ln for ln in (r.stdout + r.stderr).splitlines() if "elasticyolo-agent" in ln]
    assert r.returncode == 0 and not problems, r.stdout + r.stderr


def test_node_id_conflict_fails_clearly(etcd_server: EtcdCluster, job_name: str, tmp_path: Path) -> None:
    e = EtcdClient(etcd_server.endpoints)
    (tmp_path / "second").mkdir()
    first = AgentProcess(etcd_server.endpoints, job_name, "same", ttl=1, log_dir=tmp_path).start()
    second = AgentProcess(etcd_server.endpoints, job_name, "same", ttl=1, log_dir=tmp_path / "second")
    try:
        wait_for(lambda: e.get(JobKeys(job_name).node("same")), 10, "first registration")
        second.start()
        assert second.proc is not None and second.proc.wait(15) == 1  # FAILED after waiting 2*TTL+1
        assert any(r.get("event") == "agent failed" and "already registered" in str(r.get("reason"))
                   for r in second.log_records())
        assert first.proc is not None and first.proc.poll() is None
    finally:
        first.stop()
        second.stop()
