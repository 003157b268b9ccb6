"""Churn benchmark: does a job survive a node killed or joined every few seconds beside a CPU hog?

Per engine, one run: an embedded etcd (at its production priority), 4 `elasticyolo agent`s at the
production lease TTL (5 s), `stress-ng --cpu 2` keeping every core busy, and a job (yolov8n, 64 px
generated images). Once it trains at world 4, a seeded schedule kills (SIGKILL of a node's agent:
its workers die with it) or joins (a new agent) one node every 5-10 s, `--changes` times in all,
keeping 2 to 4 nodes. Then it waits for training to resume after the last change and reads:

* the job's state at the end (the target: never `failed`, still training);
* lease lapses the agents saw (`lease lapsed; re-registering in place` in their logs);
* workers killed by a lapse: a worker of a node that lapsed stopped by its own agent within 10 s
  after the lapse, with no bench action on that node in that time;
* hosts blacklisted (the Horovod driver's round decisions);
* re-forms: distinct restarts of training (the workers' `resume` records);
* duplicates and skipped samples over every finished epoch (the workers' committed step records).

    .venv/bin/python bench/churn.py [--engines horovod,torch] [--changes 40] [--seed 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.local_cluster.trace import final_step_records

N_TRAIN = 48
LAPSE_EVENT = "lease lapsed; re-registering in place"
STOP_EVENTS = ("stopping worker", "stopping torch launcher")
SPEC = ["model=yolov8n.yaml", "epochs=100000", "imgsz=64", "batch=4", "nbs=4", "warmup_epochs=0", "close_mosaic=0",
        "val=false", "amp=false", "workers=0", "min_nodes=1", "max_nodes=4", "gloo_timeout_s=10", "cooldown_s=5,30"]


def plan(changes: int, seed: int, gap: tuple[float, float], start: int = 4, low: int = 2,
         high: int = 4) -> list[tuple[float, str]]:
    """(delay before it, "kill" | "join") for each change, seeded; the live count stays in [low, high]."""
    rng = random.Random(seed)
    live, out = start, []
    for _ in range(changes):
        kind = "kill" if live >= high else "join" if live <= low else rng.choice(("kill", "join"))
        live += -1 if kind == "kill" else 1
        out.append((rng.uniform(*gap), kind))
    return out


def coverage_errors(events: list[dict[str, Any]]) -> tuple[int, int, int]:
    """(finished epochs, duplicates, skipped samples) over every epoch but the last one trained."""
    per_epoch: dict[int, Counter[int]] = {}
    for r in final_step_records(events):
        per_epoch.setdefault(r["epoch"], Counter()).update(r["indices"])
    done = sorted(per_epoch)[:-1]
    dup = sum(n - 1 for e in done for n in per_epoch[e].values() if n > 1)
    skipped = sum(N_TRAIN - len(per_epoch[e]) for e in done)
    return len(done), dup, skipped


def run_engine(engine: str, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    work = root / engine
    data = write_dataset(work / "data", SynthSpec(train=N_TRAIN, val=4, imgsz=64, classes=2))
    actions: list[dict[str, Any]] = []
    with EtcdCluster(size=1, root=work / "etcd") as etcd:
        c = AgentCluster(etcd.endpoints, f"churn-{engine}", work, ttl=args.ttl, env={"OMP_NUM_THREADS": "1"})
        names = iter(f"n{i}" for i in range(1, 1000))
        try:
            first = [next(names) for _ in range(4)]
            for n in first:
                c.start(n)
            c.wait(lambda: c.ready(first) and c.leader(), 120, "four agents and a leader")
            c.submit(*SPEC, f"data={data}", f"engine={engine}")
            c.wait(lambda: c.steps(world=4), args.start_s, "training at world size 4")
            t0 = time.time()
            print(f"[{engine}] training at world 4; {args.changes} changes start", flush=True)
            live = list(first)
            failed = None
            for delay, kind in plan(args.changes, args.seed, (args.min_gap, args.max_gap)):
                until = time.time() + delay
                c.wait(lambda u=until: time.time() >= u or c.job_state() == "failed", delay + 5,
                       "the next change")  # the schedule's clock
                if c.job_state() == "failed":
                    failed = c.job_record().get("reason")
                    break
                if kind == "kill":
                    victim = random.Random(args.seed + len(actions)).choice(live)
                    c.kill(victim)
                    live.remove(victim)
                else:
                    victim = next(names)
                    c.start(victim)
                    live.append(victim)
                actions.append({"t": time.time(), "kind": kind, "node": victim})
                print(f"[{engine}] t={time.time() - t0:6.1f}s {kind} {victim} -> {len(live)} nodes", flush=True)
            t_last = time.time()
            if failed is None:
                try:
                    c.wait(lambda: len(c.rank0_steps_after(t_last, len(live))) >= 3 or c.job_state() == "failed",
                           args.start_s, f"training at world {len(live)} after the last change")
                except AssertionError as exc:
                    print(f"[{engine}] {exc}", flush=True)
            record = c.job_record()
            resumed = c.rank0_steps_after(t_last, len(live))
            logs = {n: c.logs(n) for n in c.agents}
            events = c.events()
        finally:
            c.stop()
    lapses = [(n, _t(r)) for n, rs in logs.items() for r in rs if r.get("event") == LAPSE_EVENT]
    killed_by_lapse = 0
    for node, t in lapses:
        acted = any(a["node"] == node and t - 1 <= a["t"] <= t + 10 for a in actions)
        stops = [r for r in logs[node] if r.get("event") in STOP_EVENTS and t <= _t(r) <= t + 10]
        killed_by_lapse += 0 if acted else len(stops)
    blacklisted = sorted({h for rs in logs.values() for r in rs if r.get("event") == "workers recorded"
                          for h in r.get("blacklist") or []})
    reforms = len({round(e["t"]) for e in events if e["ev"] == "resume" and e.get("rank") == 0})
    epochs, dup, skipped = coverage_errors(events)
    return {"engine": engine, "end_state": record.get("state"), "reason": record.get("reason"),
            "training_after_last_change": bool(resumed), "changes": len(actions),
            "kills": sum(a["kind"] == "kill" for a in actions), "joins": sum(a["kind"] == "join" for a in actions),
            "lease_lapses": len(lapses), "workers_killed_by_lapse": killed_by_lapse,
            "hosts_blacklisted": blacklisted, "reforms": reforms, "finished_epochs": epochs,
            "duplicates": dup, "skipped": skipped}


def _t(record: dict[str, Any]) -> float:
    from datetime import datetime

    ts = record.get("timestamp")
    return datetime.fromisoformat(str(ts).replace("Z", "+00:00")).timestamp() if ts else 0.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engines", default="horovod,torch")
    ap.add_argument("--changes", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--min-gap", type=float, default=5.0)
    ap.add_argument("--max-gap", type=float, default=10.0)
    ap.add_argument("--ttl", type=int, default=5, help="the agents' lease TTL (production default 5)")
    ap.add_argument("--start-s", type=float, default=600.0, help="how long a world may take to form")
    ap.add_argument("--no-hog", action="store_true", help="without stress-ng beside the cluster")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep the clusters' files (logs, traces) in this folder")
    args = ap.parse_args()
    root = args.keep or Path(tempfile.mkdtemp(prefix="elasticyolo-churn-"))
    hog = None if args.no_hog else subprocess.Popen(["stress-ng", "--cpu", "2", "--quiet"],
                                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    results = []
    try:
        for engine in args.engines.split(","):
            results.append(run_engine(engine, args, root))
    finally:
        if hog is not None:
            hog.terminate()
            hog.wait(10)
        if args.keep is None:
            shutil.rmtree(root, ignore_errors=True)
    cols = ("engine", "end_state", "training_after_last_change", "changes", "lease_lapses",
            "workers_killed_by_lapse", "hosts_blacklisted", "reforms", "finished_epochs", "duplicates", "skipped")
    print("\n" + " | ".join(cols))
    for r in results:
        print(" | ".join(str(r[c]) for c in cols) + (f"  (reason: {r['reason']})" if r.get("reason") else ""))
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2))
    ok = all(r["end_state"] != "failed" and r["training_after_last_change"] and not r["workers_killed_by_lapse"]
             and not r["hosts_blacklisted"] and not r["duplicates"] and not r["skipped"] for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
