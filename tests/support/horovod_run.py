"""Drive a real `horovodrun` elastic job on loopback for tests, benchmarks and the demo.

Hosts come from a file read by a discovery script, so a scenario can add or remove hosts while
the job runs, and worker pids come from the workers' traces, so it can SIGKILL a given rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from elasticyolo.local_cluster.trace import pids_by_rank, read_trace
from elasticyolo.local_cluster.wait import wait_for

VENV_BIN = Path(sys.executable).parent


class HorovodElasticJob:
    def __init__(self, workdir: Path, hosts: list[str], worker_args: list[str], *, min_np: int = 1,
                 max_np: int | None = None, np: int | None = None, gloo_timeout_s: int = 5,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.hosts_file = workdir / "hosts.txt"
        self.trace_dir = workdir / "trace"
        self.progress = workdir / "progress.jsonl"
        self.log_path = workdir / "horovodrun.log"
        self.set_hosts(hosts)
        discover = workdir / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        discover.chmod(0o755)
        total = sum(int(h.split(":")[1]) for h in hosts)
        if not any(a.startswith("engine=") for a in worker_args):
            worker_args = ["engine=horovod", *worker_args]  # horovodrun runs the Horovod engine's worker
        self.cmd = [
            str(VENV_BIN / "horovodrun"), "--gloo", "-np", str(np or total), "--min-np", str(min_np),
            "--max-np", str(max_np or total), "--host-discovery-script", str(discover),
            "--network-interface", "lo", "--gloo-timeout-seconds", str(gloo_timeout_s),
            *(extra_args or []),
            str(VENV_BIN / "elasticyolo"), "worker", *worker_args, "--progress-jsonl", str(self.progress),
        ]
        self.env = {**os.environ, "ELASTICYOLO_TRACE_DIR": str(self.trace_dir), "GLOO_SOCKET_IFNAME": "lo",
                    "HOROVOD_GLOO_IFACE": "lo", "PYTHONUNBUFFERED": "1", **(env or {})}
        self.proc: subprocess.Popen | None = None  # type: ignore[type-arg]

    def set_hosts(self, hosts: list[str]) -> None:
        tmp = self.hosts_file.with_suffix(".tmp")
        tmp.write_text("".join(h + "\n" for h in hosts))
        os.replace(tmp, self.hosts_file)  # atomic: discovery may read at any time

    def start(self) -> "HorovodElasticJob":
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True, cwd=self.workdir)
        log.close()
        return self

    def events(self) -> list[dict[str, Any]]:
        return read_trace(self.trace_dir) if self.trace_dir.exists() else []

    def steps(self, world: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["ev"] == "step" and (world is None or e["world"] == world)]

    def wait_for(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """`testing.wait.wait_for`, failing at once if horovodrun exits."""
        def exited() -> str | None:
            code = self.proc.poll() if self.proc is not None else None
            return f"horovodrun exited with {code}" if code is not None else None

        return wait_for(predicate, timeout, what, interval=0.2, abort=exited)

    def kill_rank(self, rank: int) -> int:
        pid = pids_by_rank(self.events())[rank]
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait(self, timeout: float) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"horovodrun did not finish in {timeout}s; log tail:\n{self.log_tail()}")

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        # Workers started by the driver run in their own sessions: kill any left over.
        for pid in {e["pid"] for e in self.events()}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
