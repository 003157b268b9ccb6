"""A real agent started the way the shipped unit starts it (`UnitSandbox`), and jobs run through
it to the end: shared by tests/test_systemd_unit.py and bench/unit_trace.py."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.local_cluster.agents import ELASTICYOLO
from elasticyolo.local_cluster.wait import wait_for
from .unit_sandbox import UnitSandbox

REPO = Path(__file__).resolve().parents[2]


class SandboxedAgent:
    def __init__(self, sandbox: UnitSandbox, etcd: str, job: str, log_path: Path, *, slots: int = 1,
                 env: dict[str, str] | None = None, wrap: list[str] | None = None) -> None:
        """`env`: test plumbing added to the unit's environment; `wrap`: a command prefix for the
        agent inside the sandbox (e.g. strace)."""
        self.sandbox, self.etcd, self.job, self.log_path = sandbox, etcd, job, log_path
        self.client = EtcdClient(etcd)
        self.keys = JobKeys(job)
        cfg = sandbox.root / "agent.yaml"  # as /etc/elasticyolo/agent.yaml: readable, not writable
        cfg.write_text(json.dumps({"etcd": [etcd], "job": job, "node_id": "unit-node", "addr": "127.0.0.1",
                                   "host": "127.0.0.1", "slots": slots, "ttl": 3, "startup_timeout_s": 20}))
        cfg.chmod(0o644)
        self.env = sandbox.env({"PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo",
                                "HOROVOD_GLOO_IFACE": "lo", "OMP_NUM_THREADS": "1", **(env or {})})
        self.wrapped = bool(wrap)
        self.argv = [*(wrap or []), ELASTICYOLO, "agent", "--config", str(cfg)]
        self.proc: subprocess.Popen | None = None  # type: ignore[type-arg]

    def start(self) -> "SandboxedAgent":
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.sandbox.command(self.argv), env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        wait_for(lambda: self.client.get(self.keys.node("unit-node")), 60, "the sandboxed agent to register")
        return self

    def run_job(self, *pairs: str, timeout: float = 300) -> str:
        """Submit (replacing any earlier spec) and wait for done/failed; returns the state."""
        before = self.client.get(self.keys.spec)
        r = subprocess.run([ELASTICYOLO, "submit", "--etcd", self.etcd, "--job", self.job,
                            *(["--replace"] if before else []), *pairs], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            raise AssertionError(f"submit failed: {r.stderr}")
        submitted = self.client.get(self.keys.spec)[1]  # type: ignore[index]

        def finished() -> Any:
            got = self.client.get(self.keys.state)
            rec = json.loads(got[0]) if got else {}
            return rec.get("state") if rec.get("state") in ("done", "failed") and got[1] > submitted else None

        return str(wait_for(finished, timeout, f"job {' '.join(pairs)} to finish", interval=0.5))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            import psutil

            # Under a wrapper (strace) SIGTERM goes to the agent, its child: a killed strace would
            # detach and leave the agent running.
            kids = psutil.Process(self.proc.pid).children() if self.wrapped else []
            for kid in kids[:1]:
                kid.terminate()
            if not kids:
                self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.client.close()

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")
