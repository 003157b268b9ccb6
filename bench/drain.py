"""Drain benchmark: what an interruption notice buys, in one run.

One elasticyolo cluster (real agents, etcd, Horovod workers training yolov8n on generated 64 px
images, commit interval chosen by the engine: ~1 s of work), nodes A (leader), B, C at world 3:

  (a) no notice: SIGKILL node C's agent mid-epoch (what every peer does on a preemption);
  (b) notice:    the local metadata server announces an AWS spot notice for node B
                 (`--notice-s` ahead); B drains; at the deadline B is SIGKILLed if still alive.

For each, read from the workers' traces:
  lost_steps - highest step any rank executed before the new world resumed, minus the resume step
               (work that had to be redone);
  pause_s    - last step of the old world -> first step of the new world (training stopped);
  event_s    - kill (a) or notice (b) -> first step of the new world.
For (b) also notice_to_drained_s (the agent's drain_end event).

    .venv/bin/python bench/drain.py [--notice-s 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.metadata_server import MetadataServer
from elasticyolo.local_cluster.servers import EtcdCluster

SPEC = ["model=yolov8n.yaml", "epochs=500", "imgsz=64", "batch=4", "nbs=4", "warmup_epochs=0", "close_mosaic=0",
        "val=false", "amp=false", "min_nodes=1", "gloo_timeout_s=5", "cooldown_s=1,4"]


def figures(ev: list[dict[str, Any]], t_event: float, world: int) -> dict[str, Any]:
    resume = next(e for e in ev if e["ev"] == "resume" and e["t"] > t_event and e["world"] == world)
    before = [e for e in ev if e["ev"] == "step" and e["t"] < resume["t"]]
    old = [e for e in before if e["world"] == world + 1]
    first_new = min(e["t"] for e in ev if e["ev"] == "step" and e["t"] > resume["t"] and e["world"] == world)
    return {"lost_steps": max(e["step"] for e in before) - resume["step"], "resume_step": resume["step"],
            "pause_s": round(first_new - max(e["t"] for e in old), 2), "event_s": round(first_new - t_event, 2)}


def steps_after(c: AgentCluster, t: float, world: int, n: int = 3) -> bool:
    return len([s for s in c.steps(world=world) if s["t"] > t and s["rank"] == 0]) >= n


def run(notice_s: float, workdir: Path) -> dict[str, Any]:
    data = write_dataset(workdir / "data", SynthSpec(train=48, val=4, imgsz=64, classes=2))
    with EtcdCluster(size=1) as etcd, MetadataServer() as md:
        c = AgentCluster(etcd.endpoints, "bench-drain", workdir, env={"OMP_NUM_THREADS": "1"})
        try:
            c.start("a")
            c.wait(lambda: c.leader() == "a", 30, "a to lead")
            c.start("b", "--spot-provider", "aws", "--metadata-url", md.url, "--spot-poll-interval", "1",
                    "--drain-margin-s", "3")
            c.start("c")
            c.wait(lambda: c.ready(["a", "b", "c"]), 30, "three agents")
            c.submit(*SPEC, f"data={data}")
            c.wait(lambda: steps_after(c, 0, 3, 6), 300, "steps at world 3")

            # (a) SIGKILL without notice
            c.wait(lambda: [s for s in c.steps(world=3) if s["start"] > 0 and s["t"] > time.time() - 1], 60,
                   "a mid-epoch step")
            t_kill = time.time()
            c.kill("c")
            c.wait(lambda: steps_after(c, t_kill, 2), 120, "training at world 2")
            a = figures(c.events(), t_kill, 2)

            # (b) notice, then kill at the deadline
            c.wait(lambda: steps_after(c, t_kill, 2, 8), 120, "steady world 2")
            t_notice = time.time()
            md.announce("aws", in_s=notice_s)
            c.wait(lambda: steps_after(c, t_notice, 1), 120, "training at world 1")
            left = max(0.0, t_notice + notice_s - time.time())
            c.wait(lambda: c.agents["b"].proc.poll() is not None, left + 0.1, "b gone") if left else None
            if c.agents["b"].proc.poll() is None:
                c.kill("b")  # the cloud reclaims the VM at the deadline
            b = figures(c.events(), t_notice, 1)
            ends = [json.loads(v) for _, v, _ in c.client.get_prefix(c.keys.events)]
            end = next(e for e in ends if e.get("kind") == "drain_end")
            b.update(notice_to_drained_s=end.get("notice_to_drained_s"), mode=end.get("mode"),
                     agent_lost_steps=end.get("lost_steps"))
            return {"sigkill_no_notice": a, "notice_then_kill": b, "notice_s": notice_s}
        finally:
            c.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--notice-s", type=float, default=20.0, help="notice window (AWS gives 120 s)")
    ap.add_argument("--json", metavar="PATH")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-drain-") as tmp:
        out = run(args.notice_s, Path(tmp))
    a, b = out["sigkill_no_notice"], out["notice_then_kill"]
    print(f"{'case':<22}{'lost steps':>11}{'pause s':>9}{'event->step s':>15}{'notice->drained s':>19}")
    print(f"{'(a) SIGKILL, no notice':<22}{a['lost_steps']:>11}{a['pause_s']:>9}{a['event_s']:>15}{'-':>19}")
    print(f"{'(b) notice, then kill':<22}{b['lost_steps']:>11}{b['pause_s']:>9}{b['event_s']:>15}"
          f"{b['notice_to_drained_s']:>19}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
