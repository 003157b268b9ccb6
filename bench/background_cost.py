"""What background CPU work costs CPU-bound training on this host, at the checkpoint uploader's
priority. One TrainCore (the setup of bench/checkpoint_stall.py) trains in blocks of steps; a
pure-Python busy loop in another process is stopped or running in alternate blocks (A B B A ...).
It prints training's slowdown per CPU-second the loop got: what each CPU-second of uploader or
S3-server work costs a checkpoint here, whatever its priority.

    .venv/bin/python bench/background_cost.py [--blocks 16 --steps 100 --nice 19 --omp-wait default|ACTIVE]

At nice 19 the loop also runs in Linux's SCHED_IDLE class, as the uploader does. If idle-class
work took only the CPU time training leaves, the slowdown would be ~0 s per CPU-second; on a
2-core host where training keeps both cores busy, the floor for ordinary work is 0.5 s (the work
simply takes its share of two cores). Torch's intra-op thread sleeps and is woken thousands of
times a second between operations (libgomp's default wait policy); the loop runs in those gaps,
and each wake-up must then preempt it. `--omp-wait ACTIVE` (threads spin instead of sleeping)
shows the difference; it is not a production setting: spinning threads take every core from the
data loader processes between a GPU node's few CPU operations.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time

BUSY_LOOP = "x = 0\nwhile True:\n    for i in range(100000):\n        x ^= i\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=16, help="blocks of steps, half with the loop running")
    ap.add_argument("--steps", type=int, default=100, help="training steps per block")
    ap.add_argument("--nice", type=int, default=19, help="the loop's nice (19: also SCHED_IDLE, as the uploader)")
    ap.add_argument("--omp-wait", choices=("default", "ACTIVE"), default="default",
                    help="OMP_WAIT_POLICY of the training process (re-executes with it set)")
    ap.add_argument("--imgsz", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if a.omp_wait != "default" and os.environ.get("OMP_WAIT_POLICY") != a.omp_wait:
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "OMP_WAIT_POLICY": a.omp_wait})

    import psutil

    from checkpoint_stall import training_core  # the same training (this folder is on sys.path)

    core, _ = training_core(a.imgsz, a.batch, 2, a.threads, "background-cost-")
    loop = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    try:
        os.setpriority(os.PRIO_PROCESS, loop.pid, a.nice)
        if a.nice >= 19:
            os.sched_setscheduler(loop.pid, os.SCHED_IDLE, os.sched_param(0))
        os.kill(loop.pid, signal.SIGSTOP)
        proc = psutil.Process(loop.pid)

        def step() -> None:
            core.train_step()
            core.end_epoch_if_done()

        for _ in range(20):  # warm-up
            step()
        seconds: dict[bool, list[float]] = {False: [], True: []}
        loop_cpu = 0.0
        print(f"{'block':>5} {'loop':>7} {'seconds':>8} {'loop CPU-s':>11}")
        for b in range(a.blocks):
            running = b % 4 in (1, 2)
            if running:
                os.kill(loop.pid, signal.SIGCONT)
            c0, t0 = sum(proc.cpu_times()[:2]), time.perf_counter()
            for _ in range(a.steps):
                step()
            dt, got = time.perf_counter() - t0, sum(proc.cpu_times()[:2]) - c0
            if running:
                os.kill(loop.pid, signal.SIGSTOP)
                loop_cpu += got
            seconds[running].append(dt)
            print(f"{b:>5} {'running' if running else 'stopped':>7} {dt:>8.2f} {got:>11.2f}", flush=True)
    finally:
        loop.kill()
        core.close()
    stopped, running_s = statistics.fmean(seconds[False]), statistics.fmean(seconds[True])
    per_block_cpu = loop_cpu / len(seconds[True])
    print(f"training {stopped:.3f} s per {a.steps} steps with the loop stopped, {running_s:.3f} s with it running "
          f"(ratio {stopped / running_s:.3f}); the loop got {per_block_cpu:.2f} CPU-s per block at nice {a.nice}"
          f"{' (SCHED_IDLE)' if a.nice >= 19 else ''}, OMP_WAIT_POLICY {a.omp_wait}: "
          + (f"training lost {(running_s - stopped) / per_block_cpu:.2f} s per CPU-second of background work "
             f"({len(os.sched_getaffinity(0))} CPUs; ordinary work's floor on a busy host: 1/CPUs)"
             if per_block_cpu >= 0.05 else "too little CPU time to price a CPU-second of it"))


if __name__ == "__main__":
    main()
