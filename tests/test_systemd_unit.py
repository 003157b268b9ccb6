"""The shipped unit (systemd/elasticyolo-agent.service): it verifies, it is hardened (exposure
<= 2.0), a real agent with real Horovod workers trains a job under it, and a real systemd does not
restart an agent that exits on a configuration error.

The restart test runs systemd itself, as PID 1 of its own namespaces (SystemdContainer). For the
training test, where systemd is not PID 1, `systemd-run` cannot start the unit; `UnitSandbox`
reproduces what it would do: the unit's environment, only StateDirectory/CacheDirectory and a
private /tmp writable (everything else read-only, HOME too), no capabilities, an unprivileged
user, and the unit's SystemCallFilter as a seccomp filter. A write anywhere else, or a needed system call the
filter lacks, fails the job: the ProtectHome problem of the old unit cannot come back.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import boto3
import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agents import ELASTICYOLO
from elasticyolo.local_cluster.servers import EtcdCluster, S3Server, free_port
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.staging.upload import upload_dataset
from support.systemd_container import SystemdContainer
from support.unit_jobs import SandboxedAgent
from support.unit_sandbox import UnitSandbox, expand_syscall_filter, kept_under_tmp

REPO = Path(__file__).resolve().parents[1]
UNIT = REPO / "systemd" / "elasticyolo-agent.service"
needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")


def _unit_copy(tmp_path: Path) -> Path:
    # verify needs ExecStart to exist: point it at this checkout's venv
    unit = tmp_path / "elasticyolo-agent.service"
    unit.write_text(UNIT.read_text().replace("/opt/elasticyolo/.venv/bin/elasticyolo", ELASTICYOLO))
    return unit


@needs_analyze
def test_unit_verifies_and_exposure_is_ok(tmp_path: Path) -> None:
    unit = _unit_copy(tmp_path)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "elasticyolo-agent" not in r.stdout + r.stderr, r.stdout + r.stderr
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for elasticyolo-agent.service: ([0-9.]+) (\w+)", r.stdout + r.stderr)
    assert m is not None, r.stdout + r.stderr
    assert float(m.group(1)) <= 2.0 and m.group(2) == "OK", m.group(0)
    text = UNIT.read_text()
    for needle in ("DynamicUser=yes", "\nCapabilityBoundingSet=\n", "SystemCallFilter=@system-service",
                   "ProtectProc=invisible", "StateDirectory=elasticyolo", "CacheDirectory=elasticyolo",
                   "UMask=0077", "LoadCredential=etcd-password:", "ProtectHome=yes", "PrivateUsers=yes",
                   "\nRestartPreventExitStatus=2\n"):
        assert needle in text, needle
    allowed = set(expand_syscall_filter(["@system-service", "~@privileged"]))
    # what workers need from it (traced, docs/deploy.md): threads, shared memory, affinity, sockets
    for call in ("clone3", "futex", "memfd_create", "sched_setaffinity", "mbind", "ioctl", "socket", "sendmsg"):
        assert call in allowed, call
    assert "setuid" not in allowed and "mount" not in allowed


@pytest.fixture
def sandbox() -> Iterator[UnitSandbox]:
    why = UnitSandbox.available()
    if why is not None:
        pytest.skip(f"unit sandbox: {why}")
    (REPO / ".work").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="unit-", dir=REPO / ".work"))
    try:
        yield UnitSandbox(UNIT, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_agent_and_workers_train_under_the_unit(sandbox: UnitSandbox, etcd_server: EtcdCluster, s3_server: S3Server,
                                               job_name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    s3 = boto3.client("s3")
    bucket = f"unit-{job_name}"[:60].rstrip("-")
    s3.create_bucket(Bucket=bucket)
    ds = write_dataset(tmp_path / "shapes", SynthSpec(train=16, val=4, imgsz=64)).parent
    upload_dataset(ds, f"s3://{bucket}/shapes", {})
    agent = SandboxedAgent(sandbox, etcd_server.endpoints, job_name, tmp_path / "agent.log", env=s3_server.env())
    try:
        agent.start()
        assert agent.proc is not None
        status = Path(f"/proc/{agent.proc.pid}/status").read_text()  # the wrappers exec: same pid
        assert re.search(rf"Uid:\s+{sandbox.uid}\b", status) and re.search(r"Seccomp:\s+2", status), status
        assert re.search(r"CapEff:\s+0+\n", status), status
        for engine in ("horovod", "torch"):  # Horovod/Gloo workers; torch elastic's agent and workers
            state = agent.run_job(f"data=s3://{bucket}/shapes/data.yaml", "model=yolov8n.yaml", "epochs=2",
                                  "imgsz=64", "batch=4", "workers=2", f"engine={engine}", "min_nodes=1",
                                  f"checkpoint=s3://{bucket}/ckpt-{engine}", "save_period_steps=3", "s3_sse=AES256")
            assert state == "done", agent.log_text()[-4000:]
    finally:
        agent.stop()
    text = agent.log_text()
    for bad in ("Read-only file system", "Permission denied", "Operation not permitted", "PermissionError"):
        assert bad not in text, f"{bad!r} in the agent log:\n" + text[-4000:]
    state_dir, cache = sandbox.state_dirs[0], sandbox.cache_dirs[0]
    assert (state_dir / "ultralytics" / "Ultralytics" / "Arial.ttf").is_file()  # offline fonts seeded there
    assert any((cache / "datasets").glob("*/files/images/train/*.png"))  # the s3:// dataset, staged
    assert not any(sandbox.home.iterdir())  # nothing in HOME (read-only, like a dynamic user's)
    objects = s3.list_objects_v2(Bucket=bucket, Prefix="ckpt-")["Contents"]
    for engine in ("horovod", "torch"):
        assert any(o["Key"].startswith(f"ckpt-{engine}/") and o["Key"].endswith(".pt") for o in objects), engine
    for o in objects:  # every checkpoint object encrypted as the job asked
        assert s3.head_object(Bucket=bucket, Key=o["Key"]).get("ServerSideEncryption") == "AES256", o["Key"]


def _home_paths(paths: list[Path]) -> list[str]:
    """Those of `paths` under a home directory (ProtectHome= hides them)."""
    homes = ("/root", "/home", "/run/user")
    return sorted({str(p) for p in paths if any(str(p) == h or str(p).startswith(h + "/") for h in homes)})


@pytest.fixture
def systemd_units() -> Iterator[Path]:
    why = SystemdContainer.available()
    if why is not None:
        pytest.skip(f"systemd in a container: {why}")
    (REPO / ".work").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="systemd-", dir=REPO / ".work"))
    os.chmod(root, 0o755)  # the unit's dynamic user reads the agent config here
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_configuration_error_is_not_restarted_and_systemctl_status_shows_why(systemd_units: Path) -> None:
    """The shipped unit under a real systemd (PID 1 of its own namespaces): an agent that exits 2
    on a bad setting stays failed (no restart is scheduled) with its one-line reason in
    `systemctl status`; one that exits 3 (etcd unreachable at start) is restarted."""
    root = systemd_units
    units = root / "units"
    units.mkdir()
    shutil.copy(UNIT, units / UNIT.name)
    config = root / "agent.yaml"
    log = root / "agent.log"
    venv_python = Path(sys.executable)
    # What the container lacks, in a drop-in: this checkout's agent, no journal (a log file), no
    # credential files (the agent stops before reading them), an interpreter under a private home.
    drop_in = units / f"{UNIT.name}.d"
    drop_in.mkdir()
    lines = ["[Service]", "ExecStart=", f"ExecStart={ELASTICYOLO} agent --config {config}",
             f"Environment=PYTHONPATH={REPO}", "LoadCredential=", f"StandardOutput=append:{log}",
             "StandardError=inherit"]
    hidden = _home_paths([Path(sys.base_prefix).resolve(), REPO, venv_python.parent.parent.resolve()])
    if hidden:  # a home directory as tmpfs with only these in it (ProtectHome=yes hides them all)
        lines += ["ProtectHome=tmpfs", *(f"BindReadOnlyPaths={p}" for p in hidden)]
    # A checkout under /tmp (the unit's PrivateTmp= hides it): bound into the private /tmp.
    lines += [f"BindReadOnlyPaths={p}" for p in kept_under_tmp([Path(sys.base_prefix).resolve(), REPO,
                                                                venv_python.parent.parent.resolve()])]
    (drop_in / "test.conf").write_text("\n".join(lines) + "\n")
    port = free_port()  # nothing listens there
    config.write_text(f"etcd: 127.0.0.1:{port}\nttl: soon\n")
    config.chmod(0o644)
    unit = "elasticyolo-agent.service"
    props = ("ActiveState", "SubState", "Result", "ExecMainStatus", "NRestarts", "StatusText")
    with SystemdContainer(units, root / "systemd.log") as systemd:
        systemd.systemctl("start", unit)  # fails: the agent exits before READY=1
        state = wait_for(lambda: (s := systemd.show(unit, *props))["ExecMainStatus"] != "0" and s, 60,
                         "the agent to exit on its bad setting")
        # A restart would show as SubState=auto-restart now; failed means none is scheduled.
        assert state["ExecMainStatus"] == "2" and state["SubState"] == "failed", state | {"log": _tail(log)}
        assert state["NRestarts"] == "0", state
        assert state["StatusText"].startswith("configuration error: invalid agent config") and "ttl" in \
            state["StatusText"], state
        status = systemd.systemctl("status", unit).stdout
        assert re.search(r'Status: "configuration error: invalid agent config.*ttl', status), status

        # etcd unreachable at start (exit 3) is transient: systemd restarts the agent
        config.write_text(f"etcd: 127.0.0.1:{port}\nstartup_timeout_s: 1\n")
        systemd.systemctl("reset-failed", unit)
        systemd.systemctl("start", unit)
        state = wait_for(lambda: (s := systemd.show(unit, *props))["NRestarts"] not in ("", "0") and s, 90,
                         "systemd to restart the agent after exit 3")
        assert state["ExecMainStatus"] in ("0", "3"), state  # 0: the restarted one is running
        assert "etcd unreachable" in log.read_text(), _tail(log)


def _tail(path: Path) -> str:
    return path.read_text()[-3000:] if path.exists() else "(no log)"
