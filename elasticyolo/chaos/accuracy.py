"""Does elastic training on a real trace learn as well as training without interruptions?

After the replay, the elastic job's newest epoch-end checkpoint (epoch E) is compared with an
uninterrupted run of the same spec (at the world size the elastic job started at, no membership
change, no notice: `replay.first_world` says why) trained to the end of the same epoch E: the
same samples, each seen once per epoch.
Both checkpoints are validated by Ultralytics' own validator on the same validation set
(`chaos/evaluate.py`, in a child process: this one imports no torch). The target: mAP50-95
within `TOLERANCE` of each other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from elasticyolo.chaos.nodes import ReplayEnv, store_uri
from elasticyolo.chaos.runner import ELASTIC_JOB, REFERENCE_JOB, run_reference

TOLERANCE = 0.05


def _evaluate(env: ReplayEnv, *args: str, timeout_s: float = 600.0) -> str:
    proc = subprocess.run([sys.executable, "-m", "elasticyolo.chaos.evaluate", *args], capture_output=True,
                          text=True, timeout=timeout_s, env={**os.environ, **env.s3_env, "OMP_NUM_THREADS": "2"})
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"checkpoint evaluation failed: {tail}")
    return proc.stdout.strip().splitlines()[-1]


def check_accuracy(env: ReplayEnv, data: Path, imgsz: int, world: int, max_nodes: int,
                   timeout_s: float) -> dict[str, Any]:
    uri = store_uri(env)
    epoch = int(_evaluate(env, "epoch-end", "--store", uri, "--job", ELASTIC_JOB))
    if epoch < 0:
        return {"error": "the elastic run finished no epoch: nothing to compare"}
    env.say(f"accuracy: an uninterrupted run at world size {world} to the end of epoch {epoch}, "
            "then both validated")
    run_reference(env, REFERENCE_JOB, world, max_nodes, epoch, timeout_s)
    got = json.loads(_evaluate(env, "map", "--store", uri, "--job", ELASTIC_JOB, "--job", REFERENCE_JOB,
                               "--epoch", str(epoch), "--data", str(data), "--imgsz", str(imgsz)))
    elastic, reference = got[ELASTIC_JOB], {**got[REFERENCE_JOB], "world": world}
    out: dict[str, Any] = {"epoch": epoch, "elasticyolo": elastic, "uninterrupted": reference,
                           "tolerance": TOLERANCE}
    if "mAP50-95" in elastic and "mAP50-95" in reference:
        diff = round(abs(elastic["mAP50-95"] - reference["mAP50-95"]), 4)
        out.update(map50_95_difference=diff, within_tolerance=diff <= TOLERANCE)
    return out
