"""Plain `torchrun --rdzv-backend=etcd3` on loopback: run to the end, lose a node, gain a node,
lose an etcd member. Each "node" is one torchrun process (agent) with one gloo worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest

pytest.importorskip("torch")

from elasticyolo.engines.torch.rendezvous import EtcdRendezvousBackend  # noqa: E402
from elasticyolo.local_cluster.wait import wait_for  # noqa: E402
from elasticyolo.processes import running  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "torch_scripts"
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
# Short timeouts: a dead node leaves the rendezvous after keep_alive_interval * max_attempt.
RDZV_CONF = "join_timeout=40,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4,read_timeout=30"


class Nodes:
    """Starts torchrun agents in their own sessions; kills whatever is left at teardown."""

    def __init__(self, tmp: Path, endpoints: str, run_id: str) -> None:
        self.tmp, self.endpoints, self.run_id = tmp, endpoints, run_id
        self.procs: dict[str, subprocess.Popen] = {}  # type: ignore[type-arg]
        self.stop_file = tmp / "stop"

    def start(self, name: str, script: str) -> subprocess.Popen:  # type: ignore[type-arg]
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
               "EY_OUT": str(self.tmp), "EY_LOG": str(self.log(name)), "EY_STOP": str(self.stop_file),
               "EY_NODE": name, "PYTHONUNBUFFERED": "1", "LOGLEVEL": "INFO"}
        cmd = [TORCHRUN, "--rdzv-backend=etcd3", f"--rdzv-endpoint={self.endpoints}", f"--rdzv-id={self.run_id}",
               "--nnodes=1:4", "--nproc-per-node=1", "--max-restarts=10", "--monitor-interval=0.3",
               "--local-addr=127.0.0.1", f"--rdzv-conf={RDZV_CONF}", str(SCRIPTS / script)]
        out = open(self.tmp / f"{name}.agent.log", "w")
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=self.tmp,
                                start_new_session=True)
        out.close()
        self.procs[name] = proc
        return proc

    def log(self, name: str) -> Path:
        return self.tmp / f"{name}.steps.jsonl"

    def steps(self, name: str) -> list[dict]:
        path = self.log(name)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_for(self, what: str, cond: Callable[[], object], timeout: float) -> object:
        def failed() -> str | None:
            for name, p in self.procs.items():
                if p.poll() not in (None, 0, -9):
                    return f"{name} exited {p.returncode}\n{self.agent_log(name)}"
            return None

        return wait_for(cond, timeout, what, interval=0.1, abort=failed,
                        context=lambda: "\n".join(f"--- {n}\n{self.agent_log(n)}" for n in self.procs))

    def first_step(self, name: str, world: int, after: float) -> dict | None:
        return next((s for s in self.steps(name) if s["world"] == world and s["t"] > after), None)

    def agent_log(self, name: str) -> str:
        return (self.tmp / f"{name}.agent.log").read_text()[-4000:]

    def stop_all(self, timeout: float = 60) -> dict[str, int | None]:
        self.stop_file.touch()
        codes: dict[str, int | None] = {}
        for name, p in self.procs.items():
            try:
                codes[name] = p.wait(timeout) if p.returncode is None else p.returncode
            except subprocess.TimeoutExpired:
                codes[name] = None
        return codes

    def kill_all(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)  # the agent's session: agent + workers
            except ProcessLookupError:
                pass
            p.wait(10)


@pytest.fixture
def nodes_factory(tmp_path: Path) -> Iterator[Callable[[str, str], Nodes]]:
    made: list[Nodes] = []

    def make(endpoints: str, run_id: str) -> Nodes:
        EtcdRendezvousBackend(endpoints, run_id).clear()
        n = Nodes(tmp_path, endpoints, run_id)
        made.append(n)
        return n

    yield make
    for n in made:
        n.kill_all()


def _gone(pid: int) -> bool:
    return not running(pid)


def test_torchrun_two_nodes_run_to_the_end(etcd_server, job_name, nodes_factory, tmp_path: Path) -> None:
    nodes = nodes_factory(etcd_server.endpoints, job_name)
    a, b = nodes.start("a", "allreduce.py"), nodes.start("b", "allreduce.py")
    assert a.wait(90) == 0, nodes.agent_log("a")
    assert b.wait(30) == 0, nodes.agent_log("b")
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["world"], r["sum"]) for r in results] == [(2, 3.0), (2, 3.0)]


def test_torchrun_survives_node_loss_and_grows_on_join(etcd_server, job_name, nodes_factory) -> None:
    nodes = nodes_factory(etcd_server.endpoints, job_name)
    nodes.start("a", "loop.py")
    b = nodes.start("b", "loop.py")
    nodes.wait_for("world 2", lambda: nodes.first_step("a", 2, 0) and nodes.first_step("b", 2, 0), 90)
    t_world = time.time()
    nodes.wait_for("both stepping on at world 2",
                   lambda: nodes.first_step("a", 2, t_world) and nodes.first_step("b", 2, t_world), 30)

    # SIGKILL B's agent only: its worker must die too (PDEATHSIG in the worker; see docs).
    worker_b = nodes.steps("b")[-1]["pid"]
    t_kill = time.time()
    b.send_signal(signal.SIGKILL)
    b.wait(5)
    step = nodes.wait_for("survivor at world 1", lambda: nodes.first_step("a", 1, t_kill), 60)
    kill_to_step = step["t"] - t_kill  # type: ignore[index]
    nodes.wait_for("B's worker gone", lambda: _gone(worker_b), 10)

    # A third node joins: the stock handler hangs here; ours grows the world.
    t_join = time.time()
    nodes.start("c", "loop.py")
    step = nodes.wait_for("world 2 again", lambda: nodes.first_step("a", 2, t_join), 90)
    join_to_step = step["t"] - t_join  # type: ignore[index]
    nodes.wait_for("c stepping", lambda: nodes.first_step("c", 2, t_join), 30)

    codes = nodes.stop_all()
    assert codes["a"] == 0 and codes["c"] == 0, (codes, nodes.agent_log("a"), nodes.agent_log("c"))
    print(f"\nTIMING kill_to_next_step={kill_to_step:.2f}s join_to_next_step={join_to_step:.2f}s")
    assert kill_to_step < 30 and join_to_step < 60


def test_torchrun_survives_etcd_member_loss(etcd_cluster3, job_name, nodes_factory) -> None:
    # m0 is listed first in --rdzv-endpoint: every agent talks to it until it dies.
    nodes = nodes_factory(etcd_cluster3.endpoints, job_name)
    nodes.start("a", "loop.py")
    nodes.start("b", "loop.py")
    nodes.wait_for("world 2", lambda: nodes.first_step("a", 2, 0) and nodes.first_step("b", 2, 0), 90)

    t_kill = time.time()
    etcd_cluster3.kill_member(etcd_cluster3.members[0])
    # Training goes on (heartbeats fail over), and a new rendezvous round works without m0.
    nodes.wait_for("steps 2.5 s after the etcd member died", lambda: nodes.first_step("a", 2, t_kill + 2.5), 30)
    t_join = time.time()
    nodes.start("c", "loop.py")
    nodes.wait_for("world 3", lambda: all(nodes.first_step(n, 3, t_join) for n in "abc"), 90)
    codes = nodes.stop_all()
    assert set(codes.values()) == {0}, (codes, nodes.agent_log("a"))
