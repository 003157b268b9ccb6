"""Recovery benchmark for both engines, side by side with their baselines, in one run:

* `elasticyolo`   - `elasticyolo agent` daemons with engine=horovod (the leader's agent runs
                    Horovod's ElasticDriver with etcd discovery; node agents launch pre-warmed workers);
* `horovodrun`    - stock `horovodrun --gloo` elastic with a host discovery script (same worker);
* `elasticyolo-torch` - the same agents with engine=torch (the default: the survivors' workers
                    re-form their process group in place, engines/torch/worker.py);
* `torchrun-c10d` - stock `torchrun --rdzv-backend=c10d`, which restarts the world on every
                    membership change (the torch engine's worker: same TrainCore/model/data; see
                    bench/recovery_torch.py, whose runner is reused).

Same model and data everywhere: yolov8n on 24 generated 64 px images, batch 4 per worker, gloo on
loopback (Gloo timeout 5 s for the Horovod runs), one worker per "node", OMP_NUM_THREADS=1.
Schedule of one run (each event once the world has trained 6 steps and, for elasticyolo, every
node's warm standby worker is ready again: real spot events are minutes apart): nodes A, B, C
train at world 3; C is SIGKILLed (process death: its agent for
elasticyolo/torchrun, its worker + discovery entry for horovodrun); node D starts; then a node of
the new world vanishes (SIGSTOP of its agent and every process under it - nothing is closed; for
horovodrun its worker is stopped and dropped from discovery), and is SIGKILLed after the
measurement. Figures, read from the workers' traces:

  (a) loss_s: SIGKILL -> the first step of the new (2-worker) world completed by every rank;
  (b) join_pause_s: how long the running workers stop when D joins: the gap between the last
      step of the old world and the first step of the new one, less one normal step;
  (c) vanish_s: SIGSTOP -> the first step of the 2-worker world completed by every rank.

Each system runs `--repeat` times (default 3); the table shows medians, and the ratios
elasticyolo / baseline of the medians.

    .venv/bin/python bench/recovery.py [--which elasticyolo,...] [--repeat 3] [--json out.json]
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
from typing import Any, Callable, Sequence

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.local_cluster.trace import pids_by_rank, read_trace
from elasticyolo.processes import process_tree, signal_each

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: tests/support's job drivers
from tests.support.horovod_run import HorovodElasticJob  # noqa: E402

ALL = ("elasticyolo", "elasticyolo-torch", "horovodrun", "torchrun-c10d")
NO_STEP_S = 120.0  # a run that does not train within this long after a loss counts as "no step"
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


# ---- scenarios: start(node) / kill(node) / freeze() / events() / close() ------------------
class ElasticyoloRun:
    def __init__(self, tmp: Path, endpoints: str, data: Path, engine: str = "horovod") -> None:
        env = {"OMP_NUM_THREADS": "1"}
        self.c = AgentCluster(endpoints, f"bench-{tmp.name}", tmp, env=env)  # one job per run
        self.data, self.submitted, self.engine = data, False, engine
        self.frozen: list[int] = []

    def start(self, node: str) -> None:
        self.c.start(node)
        if not self.submitted and len(self.c.agents) == 3:
            self.c.wait(lambda: self.c.ready(list(self.c.agents)), 30, "agents registered")
            self.c.submit(*spec_pairs(self.data), f"engine={self.engine}")
            self.submitted = True

    def _victim(self, node: str) -> str:
        # Measure the loss of a worker node, not of the leader (that is a different path).
        live = [n for n in self.c.agents if self.c.agents[n].proc.poll() is None and not self._is_frozen(n)]
        return node if node in live and self.c.leader() != node else next(n for n in live if n != self.c.leader())

    def _is_frozen(self, node: str) -> bool:
        proc = self.c.agents[node].proc
        return proc is not None and proc.pid in self.frozen

    def kill(self, node: str) -> None:
        self.c.kill(self._victim(node))

    def freeze(self) -> None:
        proc = self.c.agents[self._victim("")].proc
        assert proc is not None
        self.frozen = process_tree(proc.pid)
        signal_each(self.frozen, signal.SIGSTOP)

    def unfreeze_kill(self) -> None:
        signal_each(self.frozen, signal.SIGKILL)

    def events(self) -> list[dict[str, Any]]:
        return self.c.events()

    def settled(self) -> bool:
        """Every live node's newest warm worker is warm (`worker_runtime/prewarm.py` logs both). Spot
        events are minutes apart; this run's are seconds apart, so each event waits for the
        standby the previous one used up to be replaced, as it would be in a real cluster."""
        for node, agent in self.c.agents.items():
            if agent.proc is None or agent.proc.poll() is not None or self._is_frozen(node):
                continue
            records = agent.log_records()
            warming = [r.get("pid") for r in records if r.get("event") == "warming worker"]
            warm = {r.get("pid") for r in records if r.get("event") == "worker warm"}
            if warming and warming[-1] not in warm:
                return False
        return True

    def close(self) -> None:
        self.unfreeze_kill()
        self.c.stop()


class HorovodrunRun:
    HOSTS = {"a": "localhost", "b": "127.0.0.1", "c": socket.gethostname(), "d": socket.gethostname()}

    def __init__(self, tmp: Path, data: Path) -> None:
        self.tmp, self.data = tmp, data
        self.hosts: list[str] = []
        self.job: HorovodElasticJob | None = None
        self.frozen: list[int] = []

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

    def freeze(self) -> None:
        # The node vanishes without closing anything: its worker stops, discovery drops it.
        assert self.job is not None
        node = next(n for n in reversed(self.hosts) if self.HOSTS[n] != "localhost")  # not rank 0's host
        pid = self.pid_on(self.HOSTS[node])
        self.hosts.remove(node)
        self.job.set_hosts([self._host_line(n) for n in self.hosts])
        self.frozen = process_tree(pid)
        signal_each(self.frozen, signal.SIGSTOP)

    def unfreeze_kill(self) -> None:
        signal_each(self.frozen, signal.SIGKILL)

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
        self.unfreeze_kill()
        if self.job is not None:
            self.job.stop()


class TorchrunRun:
    def __init__(self, tmp: Path, data: Path) -> None:
        mod = _load_torch_bench()
        self.inner = mod.Torchrun(tmp, data, share_store=True)
        from elasticyolo.spec import TrainSpec

        self.inner.spec = TrainSpec.from_pairs([*COMMON, f"data={data}", "engine=torch"])
        self.frozen: list[int] = []

    def start(self, node: str) -> None:
        self.inner.start(node)
        if node == "a":
            time.sleep(0.5)  # A first: with c10d it hosts the store

    def kill(self, node: str) -> None:
        self.inner.kill(node)

    def freeze(self) -> None:
        # A node other than A (A hosts the c10d store: losing it ends a c10d job by design).
        node = next(n for n in ("d", "b", "c") if n in self.inner.procs and self.inner.procs[n].poll() is None)
        self.frozen = process_tree(self.inner.procs[node].pid)
        signal_each(self.frozen, signal.SIGSTOP)

    def unfreeze_kill(self) -> None:
        signal_each(self.frozen, signal.SIGKILL)

    def events(self) -> list[dict[str, Any]]:
        return self.inner.events()

    def close(self) -> None:
        self.unfreeze_kill()
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


def settled(sc: Any) -> Callable[[list[dict[str, Any]]], bool]:
    """A wait condition: the system's own readiness for the next event (if it has one)."""
    check = getattr(sc, "settled", None)
    return lambda _ev: check() if check is not None else True


def run_one(name: str, tmp: Path, endpoints: str, data: Path) -> dict[str, Any]:
    sc: Any = (ElasticyoloRun(tmp, endpoints, data) if name == "elasticyolo"
               else ElasticyoloRun(tmp, endpoints, data, engine="torch") if name == "elasticyolo-torch"
               else HorovodrunRun(tmp, data) if name == "horovodrun" else TorchrunRun(tmp, data))
    out: dict[str, Any] = {}
    try:
        for n in ("a", "b", "c"):
            sc.start(n)
        if not wait(sc.events, lambda ev: len(rank0_steps(ev, 3)) >= 6, 300):
            return {"error": "never trained at world 3"}
        wait(sc.events, settled(sc), 120)
        t_kill = time.time()
        sc.kill("c")
        step = wait(sc.events, lambda ev: first_step(ev, t_kill, 2), NO_STEP_S)
        out["loss_s"] = round(step["t"] - t_kill, 2) if step else None
        if step is None:
            return {**out, "error": "no step after the kill"}
        wait(sc.events, lambda ev: len(rank0_steps(ev, 2, after=step["t"])) >= 6, 120)
        wait(sc.events, settled(sc), 120)
        t_join = time.time()
        sc.start("d")
        new = wait(sc.events, lambda ev: first_step(ev, t_join, 3), 180)
        if new is None:
            return {**out, "join_pause_s": None, "error": "no step at world 3 after the join"}
        ev = sc.events()
        old = rank0_steps(ev, 2, after=step["t"], before=new["t"])
        gaps = [b - a for a, b in zip(old, old[1:])]
        normal = statistics.median(gaps) if gaps else 0.0
        out["join_pause_s"] = round(max(0.0, new["t"] - old[-1] - normal), 2) if old else None
        out["join_total_s"] = round(new["t"] - t_join, 2)
        out["step_s"] = round(normal, 2)
        # (c) a node of the new world vanishes.
        wait(sc.events, lambda ev: len(rank0_steps(ev, 3, after=new["t"])) >= 6, 120)
        wait(sc.events, settled(sc), 120)
        t_freeze = time.time()
        sc.freeze()
        gone = wait(sc.events, lambda ev: first_step(ev, t_freeze, 2), NO_STEP_S)
        sc.unfreeze_kill()
        out["vanish_s"] = round(gone["t"] - t_freeze, 2) if gone else None
        if gone is None:
            out["error"] = f"no step within {NO_STEP_S:g} s after a node vanished"
        return out
    finally:
        sc.close()


def print_ratios(results: dict[str, Any], systems: Sequence[str], bases: Sequence[str], keys: Sequence[str]) -> None:
    """One line per figure, system and baseline measured: the ratio of their medians."""
    for mine in systems:
        e = results.get(mine, {}).get("median", {})
        for base in bases:
            b = results.get(base, {}).get("median", {})
            for key in keys:
                if e.get(key) is not None and b.get(key):
                    print(f"{key} {mine} / {base}: {e[key] / b[key]:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--which", default=",".join(ALL))
    ap.add_argument("--repeat", type=int, default=3, help="runs per system (the table shows medians)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("HOROVOD_GLOO_IFACE", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    root = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    data = write_dataset(root / "data", SynthSpec(train=24, val=4, imgsz=64, classes=2))
    runs: dict[str, list[dict[str, Any]]] = {}
    names = args.which.split(",")
    with EtcdCluster(size=1) as etcd:
        for i in range(args.repeat):  # interleaved, so load changes on the machine hit every system alike
            for name in names:
                tmp = root / f"{name}-{i}"
                tmp.mkdir()
                t0 = time.monotonic()
                r = run_one(name, tmp, etcd.endpoints, data)
                r["wall_s"] = round(time.monotonic() - t0, 1)
                runs.setdefault(name, []).append(r)
                print(f"{name:18s} run {i + 1}: {json.dumps(r)}", flush=True)
    results = {name: {"median": medians(rs), "runs": rs} for name, rs in runs.items()}
    print(f"\nmedians of {args.repeat} runs. (a) SIGKILL of 1 of 3 nodes -> first step of the new world; "
          "(b) pause of the running world on a join; (c) a node vanishes (SIGSTOP) -> first step of the new world")
    print(f"{'system':18s} {'loss_s':>8s} {'join_pause_s':>13s} {'join_total_s':>13s} {'vanish_s':>9s} {'step_s':>7s}")
    for name, res in results.items():
        m = res["median"]
        errors = sorted({r["error"] for r in res["runs"] if r.get("error")})
        print(f"{name:18s} {_f(m.get('loss_s')):>8s} {_f(m.get('join_pause_s')):>13s} "
              f"{_f(m.get('join_total_s')):>13s} {_f(m.get('vanish_s')):>9s} {_f(m.get('step_s')):>7s}  "
              f"{'; '.join(errors)}")
    print_ratios(results, ("elasticyolo", "elasticyolo-torch"), ("horovodrun", "torchrun-c10d"),
                 ("loss_s", "join_pause_s", "vanish_s"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"work dir kept: {root}")
    return 0


def medians(rs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per figure, the median over the runs that trained at all; a run without the figure (no
    step) counts as NO_STEP_S, so a system that fails in most runs shows no better than that."""
    out: dict[str, float | None] = {}
    rs = [r for r in rs if r.get("error") != "never trained at world 3"]  # no measurement at all
    for key in ("loss_s", "join_pause_s", "join_total_s", "vanish_s", "step_s"):
        vals = [r.get(key) for r in rs]
        if all(v is None for v in vals):
            out[key] = None
            continue
        got = sorted(NO_STEP_S if v is None else float(v) for v in vals)
        out[key] = round(statistics.median(got), 2)
    return out


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}"


if __name__ == "__main__":
    sys.exit(main())
