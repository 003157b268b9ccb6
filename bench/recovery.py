"""Recovery benchmark for the Horovod engine, side by side with its baselines, in one run:

* `elasticyolo`   - `elasticyolo agent` daemons (engine=horovod: the leader's agent runs Horovod's
                    ElasticDriver with etcd discovery; node agents launch pre-warmed workers);
* `horovodrun`    - stock `horovodrun --gloo` elastic with a host discovery script (same worker);
* `torchrun-c10d` - stock `torchrun --rdzv-backend=c10d`, which restarts the world on every
                    membership change (the torch engine's worker: same TrainCore/model/data; see
                    bench/recovery_torch.py, whose runner is reused).

Same model and data everywhere: yolov8n on 24 generated 64 px images, batch 4 per worker, gloo on
loopback, one worker per "node", OMP_NUM_THREADS=1. Schedule: nodes A, B, C train at world 3;
C is SIGKILLed (its agent for elasticyolo/torchrun, its worker + discovery entry for horovodrun);
then node D starts. Figures, read from the workers' traces:

  (a) loss_s: SIGKILL -> the first step of the new (2-worker) world completed by every rank;
  (b) join_pause_s: how long the running workers stop when D joins: the gap between the last
      step of the old world and the first step of the new one, less one normal step.

    .venv/bin/python bench/recovery.py [--which elasticyolo,horovodrun,torchrun-c10d] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.testing.agent_cluster import AgentCluster
from elasticyolo.testing.horovod_run import HorovodElasticJob
from elasticyolo.testing.servers import EtcdCluster
from elasticyolo.testing.trace import pids_by_rank, read_trace

ALL = ("elasticyolo", "horovodrun", "torchrun-c10d")
COMMON = ["model=yolov8n.yaml", "epochs=500", "imgsz=64", "batch=4", "nbs=4", "warmup_epochs=0", "close_mosaic=0",
          "val=false", "amp=false", "commit_every=2"]


def spec_pairs(data: Path) -> list[str]:
    return [*COMMON, f"data={data}", "min_nodes=2", "gloo_timeout_s=5", "cooldown_s=1,4"]


def _load_torch_bench() -> Any:
    path = Path(__file__).with_name("recovery_torch.py")
    spec = importlib.util.spec_from_file_location("recovery_torch", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---- scenarios: start(node) / kill(node) / events() / close() -----------------------------
class ElasticyoloRun:
    def __init__(self, tmp: Path, endpoints: str, data: Path) -> None:
        self.c = AgentCluster(endpoints, "bench-hvd", tmp, env={"OMP_NUM_THREADS": "1"})
        self.data, self.submitted = data, False

    def start(self, node: str) -> None:
        self.c.start(node)
        if not self.submitted and len(self.c.agents) == 3:
            self.c.wait(lambda: self.c.ready(list(self.c.agents)), 30, "agents registered")
            self.c.submit(*spec_pairs(self.data))
            self.submitted = True

    def kill(self, node: str) -> None:
        if self.c.leader() == node:  # measure the loss of a worker node, not of the leader
            node = next(n for n in self.c.agents if n != node and self.c.agents[n].proc.poll() is None)
        self.c.kill(node)

    def events(self) -> list[dict[str, Any]]:
        return self.c.events()

    def close(self) -> None:
        self.c.stop()


class HorovodrunRun:
    HOSTS = {"a": "localhost", "b": "127.0.0.1", "c": socket.gethostname(), "d": socket.gethostname()}

    def __init__(self, tmp: Path, data: Path) -> None:
        self.tmp, self.data = tmp, data
        self.hosts: list[str] = []
        self.job: HorovodElasticJob | None = None

    def _host_line(self, node: str) -> str:
        return f"{self.HOSTS[node]}:1"

    def start(self, node: str) -> None:
        self.hosts.append(node)
        lines = [self._host_line(n) for n in self.hosts]
        if self.job is None and len(self.hosts) == 3:
            args = [p for p in spec_pairs(self.data) if not p.startswith(("min_nodes", "cooldown_s"))]
            self.job = HorovodElasticJob(self.tmp, lines, args, min_np=2, max_np=4, np=3, gloo_timeout_s=5,
                                         extra_args=["--blacklist-cooldown-range", "1", "4"],
                                         env={"OMP_NUM_THREADS": "1"}).start()
        elif self.job is not None:
            self.job.set_hosts(lines)

    def kill(self, node: str) -> None:
        # The node vanishes: its worker dies and discovery stops listing it.
        assert self.job is not None
        self.hosts.remove(node)
        pid = self.pid_on(self.HOSTS[node])
        self.job.set_hosts([self._host_line(n) for n in self.hosts])
        os.kill(pid, signal.SIGKILL)

    def pid_on(self, host: str) -> int:
        # Horovod orders new hosts by set iteration: find the worker by its HOROVOD_HOSTNAME.
        import psutil

        for pid in pids_by_rank(self.events()).values():
            try:
                if psutil.Process(pid).environ().get("HOROVOD_HOSTNAME") == host:
                    return pid
            except psutil.Error:
                continue
        raise RuntimeError(f"no worker on {host}")

    def events(self) -> list[dict[str, Any]]:
        return self.job.events() if self.job else []

    def close(self) -> None:
        if self.job is not None:
            self.job.stop()


class TorchrunRun:
    def __init__(self, tmp: Path, data: Path) -> None:
        mod = _load_torch_bench()
        self.inner = mod.Torchrun(tmp, data, share_store=True)
        from elasticyolo.spec import TrainSpec

        self.inner.spec = TrainSpec.from_pairs([*COMMON, f"data={data}", "engine=torch"])

    def start(self, node: str) -> None:
        self.inner.start(node)
        if node == "a":
            time.sleep(0.5)  # A first: with c10d it hosts the store

    def kill(self, node: str) -> None:
        self.inner.kill(node)

    def events(self) -> list[dict[str, Any]]:
        return self.inner.events()

    def close(self) -> None:
        self.inner.close()


# ---- measurement --------------------------------------------------------------------------
def wait(events: Callable[[], list[dict[str, Any]]], cond: Callable[[list[dict[str, Any]]], Any],
         timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond(events())
        if got:
            return got
        time.sleep(0.1)
    return None


def first_step(ev: list[dict[str, Any]], after: float, world: int) -> dict[str, Any] | None:
    """The first step at `world` after `after`, once every rank has done its part (latest record)."""
    firsts: dict[int, dict[str, Any]] = {}
    for e in ev:
        if e["ev"] == "step" and e["t"] > after and e["world"] == world and e["rank"] not in firsts:
            firsts[e["rank"]] = e
    if set(firsts) != set(range(world)):
        return None
    return max(firsts.values(), key=lambda e: e["t"])


def rank0_steps(ev: list[dict[str, Any]], world: int, after: float = 0.0, before: float = float("inf")) -> list[float]:
    return [e["t"] for e in ev if e["ev"] == "step" and e["rank"] == 0 and e["world"] == world and after < e["t"] < before]


def run_one(name: str, tmp: Path, endpoints: str, data: Path) -> dict[str, Any]:
    sc: Any = (ElasticyoloRun(tmp, endpoints, data) if name == "elasticyolo"
               else HorovodrunRun(tmp, data) if name == "horovodrun" else TorchrunRun(tmp, data))
    out: dict[str, Any] = {}
    try:
        for n in ("a", "b", "c"):
            sc.start(n)
        if not wait(sc.events, lambda ev: len(rank0_steps(ev, 3)) >= 6, 300):
            return {"error": "never trained at world 3"}
        t_kill = time.time()
        sc.kill("c")
        step = wait(sc.events, lambda ev: first_step(ev, t_kill, 2), 180)
        out["loss_s"] = round(step["t"] - t_kill, 2) if step else None
        if step is None:
            return {**out, "error": "no step after the kill"}
        wait(sc.events, lambda ev: len(rank0_steps(ev, 2, after=step["t"])) >= 6, 120)
        t_join = time.time()
        sc.start("d")
        new = wait(sc.events, lambda ev: first_step(ev, t_join, 3), 300)
        if new is None:
            return {**out, "join_pause_s": None, "error": "no step at world 3 after the join"}
        ev = sc.events()
        old = rank0_steps(ev, 2, after=step["t"], before=new["t"])
        gaps = [b - a for a, b in zip(old, old[1:])]
        normal = statistics.median(gaps) if gaps else 0.0
        out["join_pause_s"] = round(max(0.0, new["t"] - old[-1] - normal), 2) if old else None
        out["join_total_s"] = round(new["t"] - t_join, 2)
        out["step_s"] = round(normal, 2)
        return out
    finally:
        sc.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--which", default=",".join(ALL))
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("HOROVOD_GLOO_IFACE", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    data = write_dataset(root / "data", SynthSpec(train=24, val=4, imgsz=64, classes=2))
    results: dict[str, Any] = {}
    with EtcdCluster(size=1) as etcd:
        for name in args.which.split(","):
            tmp = root / name
            tmp.mkdir()
            t0 = time.monotonic()
            results[name] = run_one(name, tmp, etcd.endpoints, data)
            results[name]["wall_s"] = round(time.monotonic() - t0, 1)
            print(f"{name:14s} {json.dumps(results[name])}", flush=True)
    print("\n(a) SIGKILL of 1 of 3 nodes -> first step of the new world; (b) pause of the running world on a join")
    print(f"{'system':14s} {'loss_s':>8s} {'join_pause_s':>13s} {'join_total_s':>13s} {'step_s':>7s}")
    for name, r in results.items():
        print(f"{name:14s} {_f(r.get('loss_s')):>8s} {_f(r.get('join_pause_s')):>13s} "
              f"{_f(r.get('join_total_s')):>13s} {_f(r.get('step_s')):>7s}  {r.get('error', '')}")
    e = results.get("elasticyolo", {})
    for base in ("horovodrun", "torchrun-c10d"):
        b = results.get(base, {})
        for key in ("loss_s", "join_pause_s"):
            if e.get(key) is not None and b.get(key):
                print(f"{key} elasticyolo / {base}: {e[key] / b[key]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"work dir kept: {root}")
    return 0


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    sys.exit(main())
