"""What checkpointing costs the training loop: steps/s with checkpoints every N steps vs none.

One TrainCore, one process, optimizer pinned to SGD (with `optimizer=auto` Ultralytics 8.4 may
pick MuSGD, whose Newton-Schulz iterations dominate a CPU step and hide what this measures).
The two sides are continuous runs over several checkpoint intervals, interleaved (A B B A A B
...): a "with" segment takes its checkpoints at the start of each interval, so every upload has
a whole interval to land inside the segment that caused it, and the segment waits for the last
one before the next segment starts (that wait is reported, and counted against "with" if it is
not zero). So each side pays for its own uploads, and machine noise hits both alike.

Checkpoints go to a real S3 API (moto_server on 127.0.0.1) through the production
CheckpointManager: the training process takes the blocking snapshot, the uploader process
serializes, hashes and uploads. In production S3 is another machine; here the server runs at the
lowest priority Linux has (nice 19, SCHED_IDLE), yet each of its CPU-seconds still costs this
CPU-bound training about 0.75 s (bench/background_cost.py), so the figure to S3 includes the
server's work; `--store file` leaves only the node's own. Also prints the blocking snapshot time
per checkpoint against the background upload time, and each background process's CPU.

Beside the interleaved ratio, whose rounds move by a few % with the host's speed, it prints a
windowed estimate from the same runs: each checkpoint's steps, from the snapshot until its upload
has landed (plus `--tail`), against the mean step of the rest of the same interval, seconds away;
the same cut over the paired interval without checkpoints shows the estimator's own error.

    .venv/bin/python bench/checkpoint_stall.py [--interval 200 --intervals 1 --rounds 10 --imgsz 64 --batch 4 --store s3|file]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3

import elasticyolo.train  # noqa: F401
import torch

from elasticyolo.checkpoint import CheckpointManager, open_store
from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.servers import S3Server
from elasticyolo.spec import TrainSpec
from elasticyolo.train.core import TrainCore, quiet_ultralytics
from elasticyolo.train.state import build_core_checkpoint


def main() -> None:
    defaults = TrainSpec.model_fields
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--interval", type=int, default=defaults["save_period_steps"].default,
                    help="steps between checkpoints (default: the spec's save_period_steps)")
    ap.add_argument("--intervals", type=int, default=1, help="checkpoint intervals per segment")
    ap.add_argument("--rounds", type=int, default=10, help="rounds of one 'with' and one 'without' segment")
    ap.add_argument("--imgsz", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--workers", type=int, default=defaults["workers"].default, help="data loader processes")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--uploader-nice", type=int, default=None,
                    help="nice of the uploader process (default: the manager's)")
    ap.add_argument("--tail", type=float, default=1.0,
                    help="seconds after an upload landed still counted as its window (windowed estimate)")
    ap.add_argument("--store", choices=("s3", "file"), default="s3",
                    help="s3: a local S3 API server (default); file: a local directory, to tell the "
                         "uploader's own cost from the S3 server's (which is another machine in production)")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the S3 server on the way out
    core, tmp = training_core(args.imgsz, args.batch, args.workers, args.threads, "ckpt-stall-")
    with S3Server() as s3:
        # In production S3 is another machine; here moto shares the two cores with training, so
        # it runs at the lowest priority there is (which still does not make its work free).
        assert s3.proc is not None
        os.setpriority(os.PRIO_PROCESS, s3.proc.pid, 19)
        os.sched_setscheduler(s3.proc.pid, os.SCHED_IDLE, os.sched_param(0))
        os.environ.update(s3.env())
        boto3.client("s3", endpoint_url=s3.endpoint_url).create_bucket(Bucket="bench")
        store = open_store("s3://bench/stall" if args.store == "s3" else f"file://{tmp}/store")
        # Periods off: the segment decides when (at the start of each interval), as a period would.
        nice = {} if args.uploader_nice is None else {"background_nice": args.uploader_nice}
        # Retention as in production (the default keep_last): its listing and deletes are part of the cost.
        mgr = CheckpointManager(store, "bench", save_period_steps=0, save_period_s=0, **nice)
        landed: list[Any] = []
        windows: dict[tuple[int, bool, int], Interval] = {}  # (round, with checkpoints, interval in segment)

        def step() -> None:
            core.train_step()
            core.end_epoch_if_done()

        def segment(checkpoint: bool, r: int) -> tuple[float, float]:
            """Seconds for `intervals x interval` steps, and the wait for the last upload. Also
            records each interval's step times and when its upload had landed (`windows`)."""
            t = time.perf_counter()
            interval = Interval(t)
            for i in range(args.intervals * args.interval):
                if i % args.interval == 0:
                    interval = windows[(r, checkpoint, i // args.interval)] = Interval(time.perf_counter())
                    if checkpoint:
                        mgr.save(core.progress.step, core.progress.epoch, lambda: build_core_checkpoint(core),
                                 reason="period_steps")
                        interval.snapshot_s = time.perf_counter() - interval.start
                s0 = time.perf_counter()
                step()
                interval.steps.append((time.perf_counter() - interval.start, time.perf_counter() - s0))
                done = idle(mgr)  # asked on both sides alike
                if checkpoint and interval.landed_s is None and done:
                    interval.landed_s = time.perf_counter() - interval.start
            trained = time.perf_counter() - t
            waited = 0.0
            if checkpoint:
                t = time.perf_counter()
                mgr.wait(600)
                waited = time.perf_counter() - t
                if mgr.last is not None and mgr.last.reason != "warmup":
                    landed.append(mgr.last)
            return trained + waited, waited

        for _ in range(5):  # warm-up
            step()
        mgr.save(core.progress.step, core.progress.epoch, lambda: build_core_checkpoint(core), reason="warmup")
        mgr.wait(600)  # the uploader process is up and the shared-memory slots are sized
        n = args.intervals * args.interval
        cpu0 = {name: cpu_seconds(pid) for name, pid in (("uploader", mgr._proc.pid), ("s3 server", s3.proc.pid))}
        ratios, with_s, without_s, waits, pairs = [], 0.0, 0.0, [], []
        print(f"{'round':>5} {'with ckpt steps/s':>18} {'without steps/s':>16} {'ratio':>7} {'last upload wait s':>19}")
        for r in range(args.rounds):
            order = (True, False) if r % 2 == 0 else (False, True)
            got = {c: segment(c, r) for c in order}
            a, b = n / got[True][0], n / got[False][0]
            with_s, without_s = with_s + got[True][0], without_s + got[False][0]
            pairs.append((got[True][0], got[False][0]))
            waits.append(got[True][1])
            ratios.append(a / b)
            print(f"{r:>5} {a:>18.3f} {b:>16.3f} {a / b:>7.3f} {got[True][1]:>19.2f}")
        cpu = {name: cpu_seconds(pid) - cpu0[name]
               for name, pid in (("uploader", mgr._proc.pid), ("s3 server", s3.proc.pid))}
        mgr.close(timeout=120)
        manifests = list({m.key: m for m in landed}.values())
    low, high = bootstrap_interval(pairs)
    windowed = windowed_ratios(windows, args.tail)
    print(f"median ratio with/without = {statistics.median(ratios):.3f}, overall {without_s / with_s:.3f} "
          f"(95 % interval over rounds {low:.3f}-{high:.3f}) "
          f"(checkpoint every {args.interval} steps, {args.intervals} intervals x {args.rounds} rounds per side, "
          f"imgsz {args.imgsz}, batch {args.batch}, workers {core.loader.workers}, optimizer SGD; target >= 0.99)")
    if windowed is not None:
        (w, w_half), (c, c_half), n_w = windowed
        print(f"windowed: {w:.3f} +- {w_half:.3f} (95 %, {n_w} intervals): each checkpoint interval's steps from the "
              f"snapshot until {args.tail:g} s after its upload landed, against the mean step of the rest of the same "
              f"interval (seconds away, so host drift mostly cancels); the same windows over the paired intervals "
              f"without checkpoints (the estimator's own error): {c:.3f} +- {c_half:.3f}")
    if manifests:
        snap = [m.snapshot_s for m in manifests]
        up = [m.upload_s for m in manifests]
        print(f"per checkpoint ({len(manifests)} read of {args.rounds * args.intervals}, "
              f"{manifests[-1].size / 1e6:.1f} MB): blocking snapshot {statistics.median(snap):.3f} s vs background "
              f"upload {statistics.median(up):.3f} s (medians, uploader process at nice {mgr.background_nice})")
        print("background CPU seconds per checkpoint: " + ", ".join(
            f"{name} {sec / (args.rounds * args.intervals):.2f}" for name, sec in cpu.items())
            + f" (the {args.store} store; the training side's share is the snapshot above)")
        cpus = len(os.sched_getaffinity(0))
        print("their share of this machine's CPU time while training with checkpoints: " + ", ".join(
            f"{name} {sec / (with_s * cpus):.2%}" for name, sec in cpu.items())
            + " (S3 runs elsewhere in production; `--store file` measures the node's own work alone)")
    core.close()


def training_core(imgsz: int, batch: int, workers: int, threads: int, prefix: str) -> tuple[TrainCore, Path]:
    """The training this bench and bench/background_cost.py measure (and its temp folder):
    yolov8n on 128 generated images, SGD pinned, one micro-batch per optimizer step, no
    validation, loader processes started."""
    torch.set_num_threads(threads)
    quiet_ultralytics()
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    data = write_dataset(tmp / "data", SynthSpec(train=128, val=4, imgsz=imgsz, classes=2))
    spec = TrainSpec.from_pairs([f"data={data}", "model=yolov8n.yaml", "epochs=100000", f"imgsz={imgsz}",
                                 f"batch={batch}", f"nbs={batch}", "val=false", "close_mosaic=0",
                                 "warmup_epochs=0", "optimizer=SGD", f"workers={workers}"])
    core = TrainCore(spec, work_dir=tmp / "run")
    core.loader.wait_ready(120)
    return core, tmp


@dataclass
class Interval:
    """One checkpoint interval of a segment: (seconds since its start, duration) per step."""

    start: float
    snapshot_s: float = 0.0
    landed_s: float | None = None
    steps: list[tuple[float, float]] = field(default_factory=list)


def idle(mgr: CheckpointManager) -> bool:
    st = mgr.status()
    return st["uploading_step"] is None and st["pending_step"] is None


def windowed_ratios(intervals: dict[tuple[int, bool, int], Interval], tail_s: float
                    ) -> tuple[tuple[float, float], tuple[float, float], int] | None:
    """A second, finer estimate from the same runs. The interleaved comparison's rounds move by a
    few % with the host's speed; here each checkpoint's cost is measured against steps of its own
    interval: (time of the steps from the snapshot until `tail_s` after the upload landed, plus the
    snapshot) minus (as many steps at the mean step time of the rest of the interval). The paired
    interval without checkpoints, cut at the same step count, gives the estimator's own error.
    Returns ((ratio, 95 % half-width) with checkpoints, (ratio, half-width) without, intervals)."""
    def cost(iv: Interval, n_window: int) -> float | None:
        inside, rest = iv.steps[:n_window], iv.steps[n_window:]
        if len(rest) < len(iv.steps) // 4:
            return None  # the upload took most of the interval: no baseline left
        base = statistics.fmean(d for _, d in rest)
        total = iv.snapshot_s + sum(d for _, d in iv.steps)
        return (iv.snapshot_s + sum(d for _, d in inside) - len(inside) * base) / total

    with_cost, without_cost = [], []
    for (r, checkpoint, k), ckpt in sorted(intervals.items()):
        plain = intervals.get((r, False, k))  # the same interval of the same round, without
        if not checkpoint or plain is None or ckpt.landed_s is None:
            continue
        n_window = sum(1 for t, _ in ckpt.steps if t <= ckpt.landed_s + tail_s)
        got, control = cost(ckpt, n_window), cost(plain, n_window)
        if got is not None and control is not None:
            with_cost.append(got)
            without_cost.append(control)
    if len(with_cost) < 3:
        return None

    def summary(xs: list[float]) -> tuple[float, float]:
        return 1.0 - statistics.fmean(xs), 1.96 * statistics.stdev(xs) / len(xs) ** 0.5

    return summary(with_cost), summary(without_cost), len(with_cost)


def bootstrap_interval(pairs: list[tuple[float, float]], draws: int = 10000) -> tuple[float, float]:
    """95 % interval of the overall ratio (sum of "without" seconds / sum of "with" seconds),
    resampling whole rounds: how far machine noise alone moves the figure."""
    rng = random.Random(0)
    got = []
    for _ in range(draws):
        sample = [rng.choice(pairs) for _ in pairs]
        got.append(sum(b for _, b in sample) / sum(a for a, _ in sample))
    got.sort()
    return got[int(0.025 * draws)], got[int(0.975 * draws) - 1]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children, so far."""
    import psutil

    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


if __name__ == "__main__":
    main()
