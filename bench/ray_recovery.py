"""Recovery on a Ray cluster: elasticyolo's `engine=ray` against Ray Train v2's elastic
`TorchTrainer`, side by side in one run.

* `elasticyolo` - `engine=ray` (elasticyolo/engines/ray/): one training actor per node; on a
                  loss the survivors re-form their process group in memory at their last commit;
                  a new node's actor pre-warms and joins at a commit.
* `ray-train`   - Ray Train v2, `ScalingConfig(num_workers=(1, 2))`, checkpoints through
                  `ray.train.report` at every epoch's end, Ray's defaults otherwise; the training
                  function is a plain Ultralytics loop written as Ray's documentation shows
                  (bench/ray_train_yolo.py).
* `ray-train-tuned` - the same with two of Ray Train's waits shortened (not in the default run):
                  the worker group's start timeout 10 s (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S,
                  default 60: a restart that asks for the dead node's CPUs too waits it out) and
                  `elastic_resize_monitor_interval_s=5` (default 60).

Same model and data for all: yolov8n.yaml on 32 generated 64 px images (elasticyolo/data/synth.py),
batch 4 per worker, gloo. The cluster (`local_cluster/ray_cluster.py`) runs on this host in a
network namespace with only `lo` (`local_cluster/netns.py`; the benchmark's process enters it
first): a head node with no CPUs (the GCS, elasticyolo's job controller, Ray Train's controller
and driver), and training nodes of 1 CPU, one worker each. Ray's health checks are at
`TOLERANT_HEALTH_CHECK` (a node is declared dead after 10 missed checks of 1 s), so a raylet
starved by other load is not declared dead. Both systems learn of a kill from their collective
failing; Ray Train's restart at the smaller size also waits until Ray has declared the node dead.
Schedule of one run: nodes A and B train at world 2; in their 4th epoch (step 14), B is killed
(every process of the node at once, a VM gone); once the survivor trains again, node C is added.
Figures, from the workers' step traces:

  kill_s        B killed -> the first step of the world without it;
  kill_lost     steps trained before the kill that were trained again (rolled back);
  join_total_s  C added -> the first step with C in the world (when Ray Train used the new node
                at all; '-' if not within --join-timeout);
  join_pause_s  how long the running worker stopped for the join: the gap between its last step
                before the new world and the new world's first, less one normal step;
  join_lost     steps the join rolled back.

Each system runs --repeat times (default 3), interleaved; the table shows medians and the ratios
elasticyolo / Ray Train.

    nice -n 19 .venv/bin/python bench/ray_recovery.py [--repeat 3] [--which elasticyolo,ray-train,ray-train-tuned]
                                                      [--join-timeout 150] [--json out.json]
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
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/recovery.py's measurement helpers
from recovery import COMMON, first_step, print_ratios, rank0_steps, wait  # noqa: E402

from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.local_cluster.netns import LoopbackNamespace, unavailable  # noqa: E402
from elasticyolo.local_cluster.trace import read_trace  # noqa: E402

ALL = ("elasticyolo", "ray-train")
TUNED = ["--start-timeout", "10", "--resize-interval", "5"]
N_TRAIN = 32
KILL_AT_STEP = 14
NO_STEP_S = 180.0  # no step within this long after a kill counts as this long
BASELINE = Path(__file__).resolve().with_name("ray_train_yolo.py")


class System:
    """One system's job on the shared cluster, read through its workers' traces."""

    def __init__(self, cluster: Any, tmp: Path, data: Path) -> None:
        self.cluster, self.tmp, self.data = cluster, tmp, data
        self.trace = tmp / "trace"
        self.trace.mkdir(parents=True)

    def events(self) -> list[dict[str, Any]]:
        return read_trace(self.trace)

    def start(self) -> None: ...
    def stop(self) -> None: ...


class Elasticyolo(System):
    def start(self) -> None:
        from elasticyolo.engines import ray as ray_jobs

        self.job = f"bench-{self.tmp.name}"
        pairs = [*COMMON, f"data={self.data}", "engine=ray", "min_nodes=1", "max_nodes=2", "workers=0",
                 "gloo_timeout_s=30"]
        ray_jobs.submit(pairs, self.job, work_root=str(self.tmp / "nodes"),
                        runtime_env={"env_vars": {"ELASTICYOLO_TRACE_DIR": str(self.trace)}})

    def stop(self) -> None:
        from elasticyolo.engines import ray as ray_jobs

        ray_jobs.cancel(self.job)


class RayTrain(System):
    def __init__(self, cluster: Any, tmp: Path, data: Path, tuned: bool = False) -> None:
        super().__init__(cluster, tmp, data)
        self.tuned = tuned

    def start(self) -> None:
        self.node_file = self.tmp / "driver-node"
        log = open(self.tmp / "driver.log", "ab")
        self.proc = subprocess.Popen(
            [sys.executable, str(BASELINE), "--address", self.cluster.address, "--data", str(self.data),
             "--trace", str(self.trace), "--storage", str(self.tmp / "storage"), "--node-file", str(self.node_file),
             *(TUNED if self.tuned else [])],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()

    def driver_node(self) -> str | None:
        return self.node_file.read_text() if self.node_file.exists() else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ray Train's driver aborts the run on SIGINT
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)


def lost_steps(ev: list[dict[str, Any]], t_event: float) -> int | None:
    """Steps trained before the first resume after `t_event` that this resume rolled back."""
    resumes = [e for e in ev if e["ev"] == "resume" and e["t"] > t_event]
    if not resumes:
        return None
    before = [e["step"] for e in ev if e["ev"] == "step" and e["t"] < resumes[0]["t"]]
    return max(0, max(before) - resumes[0]["step"]) if before else None


def run_one(name: str, cluster: Any, tmp: Path, data: Path, join_timeout: float) -> dict[str, Any]:
    sys_: System = (Elasticyolo(cluster, tmp, data) if name == "elasticyolo"
                    else RayTrain(cluster, tmp, data, tuned=name == "ray-train-tuned"))
    out: dict[str, Any] = {}
    try:
        cluster.add()
        b = cluster.add()
        sys_.start()
        # Mid-epoch, with checkpoints of 3 epochs written (4 steps an epoch at world 2).
        if not wait(sys_.events, lambda ev: len(rank0_steps(ev, 2)) >= KILL_AT_STEP, 400):
            return {"error": "never trained at world 2"}
        if isinstance(sys_, RayTrain) and sys_.driver_node() != cluster.head_node_id():
            return {"error": "Ray Train's controller is not on the head node"}
        t_kill = time.time()
        cluster.kill(b.node_id)
        step = wait(sys_.events, lambda ev: first_step(ev, t_kill, 1), NO_STEP_S)
        out["kill_s"] = round(step["t"] - t_kill, 2) if step else None
        if step is None:
            return {**out, "error": "no step after the kill"}
        out["kill_lost"] = lost_steps(sys_.events(), t_kill)
        wait(sys_.events, lambda ev: len(rank0_steps(ev, 1, after=step["t"])) >= 6, 120)
        t_join = time.time()
        cluster.add()
        new = wait(sys_.events, lambda ev: first_step(ev, t_join, 2), join_timeout)
        if new is None:
            return {**out, "join_total_s": None, "join_pause_s": None,
                    "note": f"no step with the new node within {join_timeout:g} s"}
        ev = sys_.events()
        old = rank0_steps(ev, 1, after=step["t"], before=new["t"])
        gaps = [b2 - a2 for a2, b2 in zip(old, old[1:])]
        normal = statistics.median(gaps) if gaps else 0.0
        out["join_total_s"] = round(new["t"] - t_join, 2)
        out["join_pause_s"] = round(max(0.0, new["t"] - old[-1] - normal), 2) if old else None
        out["join_lost"] = lost_steps(ev, t_join)
        out["step_s"] = round(normal, 2)
        return out
    finally:
        sys_.stop()
        cluster.remove_all()


FIGURES = ("kill_s", "kill_lost", "join_total_s", "join_pause_s", "join_lost", "step_s")


def medians(rs: list[dict[str, Any]]) -> dict[str, float | None]:
    """Per figure, the median over the runs that trained; a kill with no step counts as NO_STEP_S."""
    out: dict[str, float | None] = {}
    rs = [r for r in rs if r.get("error") != "never trained at world 2"]
    for key in FIGURES:
        vals = [r.get(key) for r in rs]
        if key == "kill_s":
            vals = [NO_STEP_S if v is None else v for v in vals]
        got = sorted(float(v) for v in vals if v is not None)
        out[key] = round(statistics.median(got), 2) if got and len(got) == len(vals) else None
    return out


def _f(v: Any) -> str:
    return "-" if v is None else f"{v:.2f}" if isinstance(v, float) else str(v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--which", default=",".join(ALL))
    ap.add_argument("--repeat", type=int, default=3, help="runs per system (the table shows medians)")
    ap.add_argument("--join-timeout", type=float, default=150.0,
                    help="seconds to wait for a step with the added node (Ray Train checks every 60 s)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        print(f"bench/ray_recovery.py: the cluster runs in a network namespace: {reason}", file=sys.stderr)
        return 2
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    root = Path(tempfile.mkdtemp(prefix="bench-ray-recovery-"))
    data = write_dataset(root / "data", SynthSpec(train=N_TRAIN, val=4, imgsz=64, classes=2))
    runs: dict[str, list[dict[str, Any]]] = {}
    with LoopbackNamespace() as ns, ns.entered():
        from elasticyolo.local_cluster.ray_cluster import TOLERANT_HEALTH_CHECK, LocalRayCluster

        cluster = LocalRayCluster(health_check=TOLERANT_HEALTH_CHECK)
        try:
            for i in range(args.repeat):  # interleaved, so load changes on the machine hit both alike
                for name in args.which.split(","):
                    tmp = root / f"{name}-{i}"
                    t0 = time.monotonic()
                    r = run_one(name, cluster, tmp, data, args.join_timeout)
                    r["wall_s"] = round(time.monotonic() - t0, 1)
                    runs.setdefault(name, []).append(r)
                    print(f"{name:12s} run {i + 1}: {json.dumps(r)}", flush=True)
        finally:
            cluster.shutdown()
    results = {name: {"median": medians(rs), "runs": rs} for name, rs in runs.items()}
    print(f"\nmedians of {args.repeat} runs; a local Ray cluster (head + 1-CPU nodes); 2 workers, "
          "1 killed, then 1 node added")
    print(f"{'system':12s} {'kill_s':>7s} {'kill_lost':>10s} {'join_total_s':>13s} {'join_pause_s':>13s} "
          f"{'join_lost':>10s} {'step_s':>7s}")
    for name, res in results.items():
        m = res["median"]
        notes = sorted({r.get("error") or r.get("note") for r in res["runs"] if r.get("error") or r.get("note")})
        print(f"{name:12s} {_f(m['kill_s']):>7s} {_f(m['kill_lost']):>10s} {_f(m['join_total_s']):>13s} "
              f"{_f(m['join_pause_s']):>13s} {_f(m['join_lost']):>10s} {_f(m['step_s']):>7s}  {'; '.join(notes)}")
    print_ratios(results, ("elasticyolo",), ("ray-train", "ray-train-tuned"),
                 ("kill_s", "join_total_s", "join_pause_s"))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.keep:
        print(f"work dir kept: {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
