"""The nodes a replay plays its actions on: one job's simulated machines, whatever cluster runs it.

`ReplayNodes` is what the runner (`runner.py`) needs: start a node, give it a spot notice, kill it,
submit the job, and read the workers' traces and the job's records; the waits are built on those.
`AgentNodes` runs `elasticyolo agent` processes against the replay's etcd, each with a cloud
metadata server of its own (its own "VM"); `ray_nodes.RayNodes` runs Ray nodes of a local Ray
cluster (engine=ray). No torch here.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from elasticyolo.local_cluster.cpu_slices import CpuSlices
from elasticyolo.local_cluster.trace import read_trace
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.worker_runtime.prewarm import WARM_EVENT, WARMING_EVENT

Say = Callable[[str], None]


class JobFailed(AssertionError):
    """The replayed job ended in `failed`: the replay stops at once and reports it."""


def store_uri(env: ReplayEnv) -> str:
    """Where every job of the replay checkpoints (the layout keeps jobs apart)."""
    return f"s3://{env.bucket}/replay"


class ReplayNodes:
    """One job's nodes. Subclasses start, notice, kill and submit; this class waits on them."""

    def __init__(self, env: ReplayEnv, job: str, workdir: Path, sliced: bool = True) -> None:
        self.env, self.job, self.workdir = env, job, workdir
        self.slices: CpuSlices | None = env.slices if sliced else None
        self.trace_dir = workdir / "trace"
        workdir.mkdir(parents=True, exist_ok=True)
        # Drain well inside the (compressed) notice. A node polls for notices at most twice a
        # second, and at least 20 times per notice: AWS's 5 s poll is 1/24 of its 120 s notice,
        # and a 0.5 s poll would spend a quarter of a 2 s compressed one.
        self.margin_s = round(min(5.0, max(0.0, env.notice_s * 0.25)), 2)
        self.poll_s = round(max(0.05, min(0.5, env.notice_s / 20)), 3)

    # ---- what a cluster does -----------------------------------------------------------------
    def start(self, node: str) -> None:
        raise NotImplementedError

    def begin(self, first: str) -> None:
        """The first node, ready to take the job."""
        self.start(first)

    def submit(self, max_nodes: int) -> None:
        raise NotImplementedError

    def alive(self, node: str) -> bool:
        raise NotImplementedError

    def nodes(self) -> list[str]:
        """Every node started, in order."""
        raise NotImplementedError

    def notice(self, node: str, in_s: float) -> None:
        raise NotImplementedError

    def kill(self, node: str) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def job_record(self) -> dict[str, Any]:
        """The job's state record ({"state", "reason", ...}; {} before a submission)."""
        raise NotImplementedError

    def checkpoint_epoch(self) -> int | None:
        """The epoch of the job's newest checkpoint in the store; None before the first."""
        raise NotImplementedError

    def standbys_warm(self) -> bool:
        """Whatever the nodes keep ready for the next change is built."""
        return True

    def slice_name(self, node: str) -> str:
        return f"{self.job}-{node}"

    # ---- the workers' traces -----------------------------------------------------------------
    def events(self) -> list[dict[str, Any]]:
        return read_trace(self.trace_dir) if self.trace_dir.exists() else []

    def steps(self, world: int | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events() if e["ev"] == "step" and (world is None or e["world"] == world)]

    def live(self) -> list[str]:
        return [n for n in self.nodes() if self.alive(n)]

    def steps_after(self, t: float, world: int, n: int) -> bool:
        return len([s for s in self.steps(world=world) if s["t"] > t and s["rank"] == 0]) >= n

    # ---- waits -------------------------------------------------------------------------------
    def raise_if_failed(self) -> None:
        """JobFailed with the job's reason once its state is `failed` (every wait of a replay
        checks this: a dead job is reported at once, not at a wait's time limit)."""
        record = self.job_record()
        if record.get("state") == "failed":
            raise JobFailed(f"the job failed: {record.get('reason') or 'no reason recorded'}")

    def wait(self, condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.5) -> Any:
        return wait_for(condition, timeout, what, interval=interval, abort=self.raise_if_failed)

    def wait_world(self, world: int, after: float, steps: int, timeout: float, what: str) -> None:
        self.wait(lambda: self.steps_after(after, world, steps), timeout, what)

    def wait_checkpoint(self, timeout: float) -> None:
        """A job that has run a while has a checkpoint in the store: start the clock after one."""
        self.wait(lambda: self.checkpoint_epoch() is not None, timeout, "a first checkpoint in S3")

    def wait_until(self, t: float) -> None:
        """The replay clock: until wall time `t` (actions happen at trace times, not on conditions)."""
        self.wait(lambda: time.time() >= t, max(0.0, t - time.time()) + 5.0, "the replay clock", interval=0.02)

    def settle(self, timeout: float) -> None:
        """Until every node's standby is warm: a span measured before that is partly a standby's
        imports and model build (a torch-elastic round refills every node's standby; on 0.44-CPU
        nodes one took 28-38 s, at half the node). Past `timeout` it goes on and says so."""
        try:
            self.wait(self.standbys_warm, timeout, "every node's warm standby worker")
        except JobFailed:
            raise
        except AssertionError as exc:
            self.env.say(f"  going on without: {exc}")

    def wait_steps(self, after: float, n: int, timeout: float) -> None:
        self.wait(lambda: len([s for s in self.steps() if s["t"] > after and s["rank"] == 0]) >= n,
                  timeout, "steps after the last change")


class AgentNodes(ReplayNodes):
    """`elasticyolo agent` processes (local_cluster/agent_cluster.py), each with its own metadata
    server, against the replay's etcd."""

    def __init__(self, env: ReplayEnv, job: str, workdir: Path, sliced: bool = True) -> None:
        from elasticyolo.local_cluster.agent_cluster import AgentCluster
        from elasticyolo.local_cluster.metadata_server import MetadataServer

        super().__init__(env, job, workdir, sliced)
        self.cluster = AgentCluster(env.etcd_endpoints, job, workdir, env={"OMP_NUM_THREADS": "1", **env.s3_env})
        self.trace_dir = self.cluster.trace_dir
        self.md: dict[str, MetadataServer] = {}

    def start(self, node: str) -> None:
        from elasticyolo.local_cluster.metadata_server import MetadataServer

        md = self.md[node] = MetadataServer(providers=("aws",)).start()
        prefix = self.slices.prefix(self.slice_name(node)) if self.slices else []
        self.cluster.start(node, "--spot-provider", "aws", "--metadata-url", md.url, "--spot-poll-interval",
                           str(self.poll_s), "--drain-margin-s", str(self.margin_s), prefix=prefix)

    def begin(self, first: str) -> None:
        self.start(first)
        self.cluster.wait(lambda: self.cluster.leader() == first, 60, f"{first} to lead")

    def submit(self, max_nodes: int) -> None:
        self.cluster.submit(*self.env.spec, f"max_nodes={max_nodes}", f"checkpoint={store_uri(self.env)}")

    def alive(self, node: str) -> bool:
        a = self.cluster.agents.get(node)
        return a is not None and a.proc is not None and a.proc.poll() is None

    def nodes(self) -> list[str]:
        return list(self.cluster.agents)

    def notice(self, node: str, in_s: float) -> None:
        self.md[node].announce("aws", action="terminate", in_s=in_s)

    def kill(self, node: str) -> None:
        if self.alive(node):
            self.cluster.kill(node)
        if self.slices:
            self.slices.release(self.slice_name(node))

    def job_record(self) -> dict[str, Any]:
        return self.cluster.job_record()

    def checkpoint_epoch(self) -> int | None:
        rec = self.cluster.client.get(self.cluster.keys.checkpoint_latest)
        return int(json.loads(rec[0]).get("epoch", -1)) if rec is not None else None

    def standbys_warm(self) -> bool:
        """Every live node's newest warm worker (worker_runtime/prewarm.py logs when it starts
        warming and when it is warm) is warm."""
        for node in self.live():
            newest, warm = None, set()
            for r in self.cluster.logs(node):
                if r.get("event") == WARMING_EVENT:
                    newest = r.get("pid")
                elif r.get("event") == WARM_EVENT:
                    warm.add(r.get("pid"))
            if newest is not None and newest not in warm:
                return False
        return True

    def stop(self) -> None:
        try:
            self.cluster.stop()
        finally:
            if self.slices:
                for node in self.cluster.agents:
                    self.slices.release(self.slice_name(node))
            for md in self.md.values():
                md.stop()
            self.md.clear()


@dataclass
class ReplayEnv:
    """What both systems share: servers, data, the job spec."""

    etcd_endpoints: str
    s3_env: dict[str, str]
    spec: list[str]  # key=value words for `elasticyolo submit` (without the checkpoint store)
    bucket: str
    workdir: Path
    notice_s: float
    say: Say = print
    startup_timeout_s: float = 600.0
    slices: CpuSlices | None = None  # one CPU quota per node (local_cluster/cpu_slices.py), or shared CPUs
    # A job's nodes (`nodes.py`): agents, or a local Ray cluster's nodes for engine=ray.
    nodes: Callable[..., ReplayNodes] = AgentNodes
