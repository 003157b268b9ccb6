"""Real `elasticyolo agent` processes for scenario tests and benchmarks, and etcd views of them.

Scenarios are written as a schedule of kills/joins plus `wait_for(condition, deadline)`
(`local_cluster/wait.py`), never bare sleeps, so they are as fast as the cluster and fail with a
message saying what was awaited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys

ELASTICYOLO = str(Path(sys.executable).with_name("elasticyolo"))


@dataclass
class AgentProcess:
    """One `elasticyolo agent` subprocess with its log captured to a file."""

    endpoints: str
    job: str
    node_id: str
    ttl: int = 2
    log_dir: Path = Path("/tmp")
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen | None = None  # type: ignore[type-arg]
    addr: str = "127.0.0.1"  # --addr and --host
    prefix: list[str] = field(default_factory=list)  # e.g. `ip netns exec NS` (tests/support/netns.py)
    unset: tuple[str, ...] = ()  # variables of this process's environment the agent must not get

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"agent-{self.job}-{self.node_id}.log"

    def start(self) -> "AgentProcess":
        cmd = [*self.prefix, ELASTICYOLO, "agent", "--config", os.devnull, "--etcd", self.endpoints,
               "--job", self.job, "--node-id", self.node_id, "--ttl", str(self.ttl), "--addr", self.addr,
               "--host", self.addr, "--slots", "1", "--startup-timeout-s", "10", *self.extra]
        # Node-local files under the test's own directory unless the scenario says otherwise.
        inherited = {k: v for k, v in os.environ.items() if k not in self.unset}
        env = {**inherited, "ELASTICYOLO_LOG_FORMAT": "json", "ELASTICYOLO_WORK_DIR": str(self.log_dir / "nodes"),
               **self.env}
        log = open(self.log_path, "ab")
        # A session of its own, as under systemd: the agent sets its session's priority (priority.py).
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                     start_new_session=True)
        log.close()
        return self

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(10)

    def stop(self, timeout: float = 10) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    def log_records(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


class EtcdReads(Protocol):
    """The reads of the views below: an `EtcdClient`, or a reader that runs inside a network
    namespace (`tests/support/netns.py`)."""

    def get(self, key: str) -> tuple[bytes, int] | None: ...
    def get_prefix(self, prefix: str) -> list[tuple[str, bytes, int]]: ...


def nodes_in_etcd(client: EtcdReads, job: str) -> dict[str, dict[str, Any]]:
    """node id -> record, read directly from etcd."""
    keys = JobKeys(job)
    return {keys.node_id_of(k): json.loads(v) for k, v, _ in client.get_prefix(keys.nodes)}


def leader_in_etcd(client: EtcdReads, job: str) -> str | None:
    got = client.get(JobKeys(job).leader)
    return json.loads(got[0])["node_id"] if got else None


class LeaderMonitor:
    """Checks continuously (every ~20 ms, in a thread) that there are never two leaders: in one
    consistent read, at most one node record says `leader: true`, and it is the leader key's holder."""

    def __init__(self, client: EtcdClient, job: str, period: float = 0.02) -> None:
        self.client = client
        self.keys = JobKeys(job)
        self.period = period
        self.violations: list[str] = []
        self.samples = 0
        self.leaders_seen: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "LeaderMonitor":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        from elasticyolo.cluster.etcd import b64, prefix_range_end

        leader_key, nodes = self.keys.leader, self.keys.nodes
        ranges = [{"request_range": {"key": b64(leader_key)}},
                  {"request_range": {"key": b64(nodes), "range_end": b64(prefix_range_end(nodes))}}]
        while not self._stop.wait(self.period):
            try:
                result = self.client.txn([], ranges, [])  # one revision for both reads
            except Exception:  # noqa: BLE001 - etcd hiccup: skip this sample
                continue
            self.samples += 1
            rev = result["header"]["revision"]
            resp = result.get("responses") or [{}, {}]
            lk = resp[0].get("response_range", {}).get("kvs") or []
            holder = json.loads(_unb64(lk[0]["value"]))["node_id"] if lk else None
            flagged = []
            for kv in resp[1].get("response_range", {}).get("kvs") or []:
                rec = json.loads(_unb64(kv["value"]))
                if rec.get("leader"):
                    flagged.append(rec["node_id"])
            if len(flagged) > 1:
                self.violations.append(f"rev {rev}: two leader records {flagged}")
            if flagged and holder != flagged[0]:
                self.violations.append(f"rev {rev}: record {flagged[0]} says leader but the key holder is {holder}")
            if holder and (not self.leaders_seen or self.leaders_seen[-1] != holder):
                self.leaders_seen.append(holder)


def _unb64(s: str) -> bytes:
    import base64

    return base64.b64decode(s)
