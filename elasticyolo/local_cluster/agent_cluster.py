"""A local elasticyolo cluster for tests, the demo and benchmarks: real `elasticyolo agent`
processes (distinct node ids, all on 127.0.0.1) against a real etcd, training real workers.
With `loopback=False`, `start(..., addr=, prefix=)` and a `reader`, the agents run in network
namespaces of their own instead (partition tests, `tests/support/netns.py`).

Worker traces (`ELASTICYOLO_TRACE_DIR`) are shared by all agents' workers so a scenario can
find a rank's pid, prove exactly-once coverage and time recoveries.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Sequence

import psutil

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.local_cluster.agents import ELASTICYOLO, AgentProcess, EtcdReads, leader_in_etcd, nodes_in_etcd
from elasticyolo.local_cluster.trace import pids_by_rank, read_trace
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.processes import process_tree, signal_each


# Pin torch, Gloo and Horovod to loopback: every agent of a plain local cluster is on 127.0.0.1.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "HOROVOD_GLOO_IFACE": "lo", "MASTER_ADDR": "127.0.0.1"}


class AgentCluster:
    def __init__(self, endpoints: str, job: str, workdir: Path, *, ttl: int = 2, prewarm: bool = True,
                 env: dict[str, str] | None = None, client: EtcdClient | None = None, loopback: bool = True,
                 reader: EtcdReads | None = None, cli_prefix: Sequence[str] = ()) -> None:
        """`env` reaches agents and the CLI (TLS/auth: ELASTICYOLO_ETCD_CA, ...); `client`: one
        with the same TLS/auth for the test's own reads. `loopback=False`: agents on addresses of
        their own, whose interface the launcher picks from `--addr` (no loopback pinning, not even
        the test process's own); `reader`: what the etcd views read through (default `client`);
        `cli_prefix`: runs `submit`/`status` (e.g. `ip netns exec NS`)."""
        self.endpoints, self.job, self.workdir, self.ttl = endpoints, job, workdir, ttl
        self.keys = JobKeys(job)
        self.client = client or EtcdClient(endpoints)
        self.reader: EtcdReads = reader or self.client
        self.cli_prefix = list(cli_prefix)
        self.trace_dir = workdir / "trace"
        self.agents: dict[str, AgentProcess] = {}
        self.unset = () if loopback else tuple(LOOPBACK_ENV)
        self.env = {"ELASTICYOLO_TRACE_DIR": str(self.trace_dir), "ELASTICYOLO_WORK_DIR": str(workdir / "nodes"),
                    "ELASTICYOLO_PREWARM": "1" if prewarm else "0", **(LOOPBACK_ENV if loopback else {}),
                    "ELASTICYOLO_LOG_FORMAT": "json", **(env or {})}

    # ---- agents -------------------------------------------------------------------------
    def start(self, node_id: str, *extra: str, addr: str = "127.0.0.1", prefix: Sequence[str] = ()) -> AgentProcess:
        """`addr`: the agent's --addr; `prefix`: runs it (e.g. `ip netns exec NS`)."""
        a = AgentProcess(self.endpoints, self.job, node_id, ttl=self.ttl, log_dir=self.workdir, extra=list(extra),
                         env=self.env, addr=addr, prefix=list(prefix), unset=self.unset).start()
        self.agents[node_id] = a
        return a

    def kill(self, node_id: str) -> list[int]:
        """SIGKILL an agent; returns the pids of its worker processes (which must die with it)."""
        a = self.agents[node_id]
        assert a.proc is not None
        children = [p.pid for p in psutil.Process(a.proc.pid).children(recursive=True)]
        a.kill()
        return children

    def stop(self) -> None:
        for a in self.agents.values():  # a frozen agent (a scenario's SIGSTOP) must be thawed to be stopped
            if a.proc is not None and a.proc.poll() is None:
                signal_each(process_tree(a.proc.pid), signal.SIGCONT)
        for a in self.agents.values():
            a.stop(timeout=15)
        # Last resort for a broken run: no worker may outlive the cluster.
        signal_each(sorted({e["pid"] for e in self.events()}), signal.SIGKILL)

    # ---- etcd views ---------------------------------------------------------------------
    def nodes(self) -> dict[str, dict[str, Any]]:
        return nodes_in_etcd(self.reader, self.job)

    def leader(self) -> str | None:
        return leader_in_etcd(self.reader, self.job)

    def ready(self, node_ids: list[str]) -> bool:
        nodes = self.nodes()
        return all(n in nodes and nodes[n].get("state") in ("IDLE", "TRAINING") for n in node_ids)

    def job_state(self) -> str | None:
        return self.job_record().get("state")

    def job_record(self) -> dict[str, Any]:
        """The job's state record ({"state", "reason", ...}; {} before a submission)."""
        got = self.reader.get(self.keys.state)
        return json.loads(got[0]) if got else {}

    def world(self) -> dict[str, Any]:
        got = self.reader.get(self.keys.world)
        return json.loads(got[0]) if got else {}

    def progress(self) -> dict[str, Any]:
        got = self.reader.get(self.keys.progress)
        return json.loads(got[0]) if got else {}

    def job_events(self, kind: str | None = None) -> list[dict[str, Any]]:
        """The job's event log in etcd (notices, drains, the cost summary), oldest first."""
        out = [json.loads(v) for _, v, _ in self.reader.get_prefix(self.keys.events)]
        return [e for e in out if kind is None or e.get("kind") == kind]

    def submit(self, *pairs: str) -> None:
        r = subprocess.run([*self.cli_prefix, ELASTICYOLO, "submit", "--etcd", self.endpoints, "--job", self.job,
                            *pairs],
                           capture_output=True, text=True, timeout=30, env={**os.environ, **self.env})
        if r.returncode != 0:
            raise AssertionError(f"submit failed: {r.stderr}")

    def status(self, as_json: bool = True) -> Any:
        cmd = [*self.cli_prefix, ELASTICYOLO, "status", "--etcd", self.endpoints, "--job", self.job] + \
            (["--json"] if as_json else [])
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env={**os.environ, **self.env})
        if r.returncode != 0:
            raise AssertionError(f"status failed: {r.stderr}")
        return json.loads(r.stdout) if as_json else r.stdout

    # ---- worker traces ------------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        return read_trace(self.trace_dir) if self.trace_dir.exists() else []

    def steps(self, world: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["ev"] == "step" and (world is None or e["world"] == world)]

    def pid_of_rank(self, rank: int) -> int:
        return pids_by_rank(self.events())[rank]

    def rank0_steps_after(self, t: float, world: int) -> list[dict[str, Any]]:
        """Rank 0's step records after `t` in a world of `world` ranks."""
        return [e for e in self.steps(world) if e["t"] > t and e["rank"] == 0]

    def worker_of(self, node: str) -> int:
        """The training worker pid (a rank in the current world) under `node`'s agent (its child,
        or its warm pool's zygote's: worker_runtime/zygote.py)."""
        agent = self.agents[node].proc
        assert agent is not None
        for pid in pids_by_rank(self.events()).values():
            try:
                if agent.pid in [p.pid for p in psutil.Process(pid).parents()[:2]]:
                    return pid
            except psutil.NoSuchProcess:
                continue
        raise AssertionError(f"no training worker under {node}")

    def wait(self, condition: Any, timeout: float, what: str) -> Any:
        return wait_for(condition, timeout, what, interval=0.1)

    def logs(self, node_id: str) -> list[dict[str, Any]]:
        return self.agents[node_id].log_records()
