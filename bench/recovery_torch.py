"""Recovery benchmark for the torch engine: seconds from a node's SIGKILL to the next training
step, and from a node's start to the first step with it, for

* `elasticyolo`  - `elasticyolo agent` daemons (engine=torch: LocalElasticAgent on the etcd3
                   rendezvous, local snapshots, restore of the newest state);
* `torchrun-c10d` - stock `torchrun --rdzv-backend=c10d` (its TCPStore lives on the first node);
* `torchrun-c10d-noshare` - the same with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch's own
                   workaround for the scale-up hang).

All run the same worker (`elasticyolo worker`, engine=torch: yolov8n on generated 64 px images,
batch 4 per worker, gloo on loopback), one worker per node, the same rendezvous timeouts
(last_call 1 s, keep-alive 1 s x 4) and monitor interval (0.3 s). Schedule per run: nodes A and B
train at world 2; B's agent is SIGKILLed (never the c10d store's host: that kills the c10d job);
then node C starts. Per event the phases are: detect + rendezvous + spawn (until the new worker
process exists), worker start (imports, process group, model/data build, state restore) and the
first step.

    .venv/bin/python bench/recovery_torch.py [--repeats 1] [--which elasticyolo,torchrun-c10d,...]
                                             [--join-timeout 60] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.jobs import submit_spec
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agents import AgentProcess
from elasticyolo.local_cluster.servers import EtcdCluster, free_port
from elasticyolo.local_cluster.trace import read_trace
from elasticyolo.spec import TrainSpec

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
RDZV_CONF = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4"
MONITOR = "0.1"  # torchrun's default (and the agents')
ALL = ("elasticyolo", "torchrun-c10d", "torchrun-c10d-noshare")


def spec_for(data: Path) -> TrainSpec:
    return TrainSpec.from_pairs([
        "model=yolov8n.yaml", f"data={data}", "epochs=500", "imgsz=64", "batch=4", "nbs=8", "warmup_epochs=0",
        "close_mosaic=0", "val=false", "engine=torch", "commit_every=2", "amp=false", "gloo_timeout_s=30"])


def base_env(trace: Path) -> dict[str, str]:
    return {**os.environ, "ELASTICYOLO_TRACE_DIR": str(trace), "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1",
            "GLOO_SOCKET_IFNAME": "lo", "ELASTICYOLO_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}


class Scenario:
    """Start/kill "nodes" and read the workers' traces."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.trace = tmp / "trace"

    def start(self, node: str) -> None: ...
    def kill(self, node: str) -> None: ...
    def close(self) -> None: ...

    def events(self) -> list[dict[str, Any]]:
        return read_trace(self.trace) if self.trace.exists() else []

    def wait(self, cond: Callable[[list[dict[str, Any]]], Any], timeout: float) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = cond(self.events())
            if got:
                return got
            time.sleep(0.1)
        return None


class Elasticyolo(Scenario):
    def __init__(self, tmp: Path, endpoints: str, data: Path) -> None:
        super().__init__(tmp)
        self.endpoints, self.job = endpoints, "bench-torch"
        client = EtcdClient(endpoints)
        submit_spec(client, JobKeys(self.job), spec_for(data), by="bench", replace=True)
        self.env = {k: v for k, v in base_env(self.trace).items() if k not in os.environ or k.startswith(
            ("ELASTICYOLO", "OMP", "MASTER", "GLOO", "PYTHON"))}
        self.env.update(ELASTICYOLO_WORK_DIR=str(tmp / "nodes"), ELASTICYOLO_TORCH_RDZV_CONF=RDZV_CONF,
                        ELASTICYOLO_TORCH_MONITOR_INTERVAL=MONITOR)
        self.agents: dict[str, AgentProcess] = {}

    def start(self, node: str) -> None:
        self.agents[node] = AgentProcess(self.endpoints, self.job, node, ttl=2, log_dir=self.tmp, env=self.env).start()

    def kill(self, node: str) -> None:
        self.agents[node].kill()

    def close(self) -> None:
        for a in self.agents.values():
            a.stop(timeout=30)


class Torchrun(Scenario):
    def __init__(self, tmp: Path, data: Path, share_store: bool) -> None:
        super().__init__(tmp)
        self.port = free_port()
        self.spec = spec_for(data)
        self.share_store = share_store
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, node: str) -> None:
        env = base_env(self.trace)
        env.update(ELASTICYOLO_SPEC=self.spec.to_json(), ELASTICYOLO_JOB="bench-torchrun", ELASTICYOLO_NODE_ID=node,
                   ELASTICYOLO_WORKER_DIR=str(self.tmp / "nodes" / node))
        if not self.share_store:
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        cmd = [TORCHRUN, "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=bench",
               "--nnodes=1:4", "--nproc-per-node=1", "--max-restarts=100", f"--monitor-interval={MONITOR}",
               "--local-addr=127.0.0.1", f"--rdzv-conf={RDZV_CONF}",
               "-m", "elasticyolo.worker_runtime.lifeline", "elasticyolo.cli", "worker"]
        log = open(self.tmp / f"torchrun-{node}.log", "ab")
        self.procs[node] = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        log.close()

    def kill(self, node: str) -> None:
        self.procs[node].send_signal(signal.SIGKILL)  # the agent only: its worker dies by PDEATHSIG
        self.procs[node].wait(10)

    def close(self) -> None:
        for p in self.procs.values():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(10)


def first_step(events: list[dict[str, Any]], after: float, world: int, ranks: int) -> dict[str, Any] | None:
    """The first step at `world` after `after` once every rank has reached it (the latest rank's
    record: a step is done when all ranks did their part)."""
    firsts: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["ev"] == "step" and e["t"] > after and e["world"] == world and e["rank"] not in firsts:
            firsts[e["rank"]] = e
    if set(firsts) != set(range(ranks)):
        return None
    return max(firsts.values(), key=lambda e: e["t"])


def phases(events: list[dict[str, Any]], t0: float, step: dict[str, Any] | None) -> dict[str, Any]:
    if step is None:
        return {"total_s": None}
    resumes = [e for e in events if e["ev"] == "resume" and e["t"] > t0]
    out: dict[str, Any] = {"total_s": round(step["t"] - t0, 2)}
    if resumes and all(r.get("proc_start") for r in resumes):
        spawned = max(r["proc_start"] for r in resumes)
        resumed = max(r["t"] for r in resumes)
        out.update(detect_rdzv_spawn_s=round(spawned - t0, 2), worker_start_s=round(resumed - spawned, 2),
                   first_step_s=round(step["t"] - resumed, 2), restored_from=sorted({r["source"] for r in resumes}))
    return out


def run_once(name: str, tmp: Path, endpoints: str, data: Path, join_timeout: float) -> dict[str, Any]:
    sc: Scenario = (Elasticyolo(tmp, endpoints, data) if name == "elasticyolo"
                    else Torchrun(tmp, data, share_store=(name == "torchrun-c10d")))
    try:
        sc.start("a")
        time.sleep(0.5)  # A first: with c10d it hosts the store
        sc.start("b")
        if not sc.wait(lambda ev: len([e for e in ev if e["ev"] == "step" and e["world"] == 2 and e["step"] >= 6]) >= 2,
                       240):
            return {"error": "never trained at world 2"}
        t_kill = time.time()
        sc.kill("b")
        step = sc.wait(lambda ev: first_step(ev, t_kill, 1, 1), 120)
        kill = phases(sc.events(), t_kill, step)
        if step is None:
            return {"kill": kill, "join": {"total_s": None}, "error": "no step after the kill"}
        sc.wait(lambda ev: [e for e in ev if e["ev"] == "step" and e["t"] > t_kill and e["world"] == 1
                            and e["step"] >= step["step"] + 2], 60)
        t_join = time.time()
        sc.start("c")
        step = sc.wait(lambda ev: first_step(ev, t_join, 2, 2), join_timeout)
        join = phases(sc.events(), t_join, step)
        if step is None:
            join["note"] = f"no step at world 2 within {join_timeout:.0f}s (hang)"
        return {"kill": kill, "join": join}
    finally:
        sc.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--which", default=",".join(ALL))
    ap.add_argument("--join-timeout", type=float, default=60.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (logs, traces)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    root = Path(tempfile.mkdtemp(prefix="ey-bench-torch-"))
    results: dict[str, list[dict[str, Any]]] = {}
    try:
        data = write_dataset(root / "data", SynthSpec(train=32, val=8, imgsz=64, classes=2))
        with EtcdCluster(size=1) as etcd:
            for r in range(args.repeats):
                for name in args.which.split(","):
                    tmp = root / f"{name}-{r}"
                    tmp.mkdir()
                    res = run_once(name, tmp, etcd.endpoints, data, args.join_timeout)
                    results.setdefault(name, []).append(res)
                    print(f"{name:24s} run {r}: {json.dumps(res)}", flush=True)
    finally:
        if args.keep:
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    print("\nseconds to the next training step (median over runs; '-' = never):")
    print(f"{'engine':24s} {'kill -> step':>14s} {'join -> step':>14s}")
    for name, runs in results.items():
        def med(event: str) -> str:
            vals = [r.get(event, {}).get("total_s") for r in runs]
            ok = [v for v in vals if v is not None]
            return f"{statistics.median(ok):.1f}" if ok and len(ok) == len(vals) else "-"
        print(f"{name:24s} {med('kill'):>14s} {med('join'):>14s}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
