"""Is this host's CPU speed steady? Times one fixed single-threaded workload (a pure-Python loop
and a small torch convolution, forward and backward) every `--every-s` seconds on one pinned core,
and prints the spread. Run it on an idle machine before trusting a replay's live figures
(`elasticyolo chaos replay`): the replay's ideal and both systems' runs are measured minutes apart,
and a host whose speed changes under them moves every live ratio.

    python bench/host_steadiness.py [--core 0] [--seconds 40] [--every-s 0.5]

Measured on a 2-core x86-64 VM (idle): the loop took 8.8-17.5 ms (median 10.0), bimodal at ~9
and ~17 ms in stretches of 1-5 s; the convolution 8.4-18.6 ms (median 12.2); the hypervisor
reported no steal time meanwhile (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time


def python_loop() -> int:
    s = 0
    for i in range(300_000):
        s += i * i
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--every-s", type=float, default=0.5)
    a = ap.parse_args()
    os.sched_setaffinity(0, {a.core})
    import torch

    torch.set_num_threads(1)
    conv = torch.nn.Conv2d(16, 32, 3, padding=1)
    x = torch.randn(4, 16, 64, 64)

    def convolution() -> None:
        for _ in range(3):
            conv(x).sum().backward()

    convolution(), python_loop()  # warm
    loop_ms, conv_ms = [], []
    t0 = time.monotonic()
    while time.monotonic() - t0 < a.seconds:
        t1 = time.perf_counter()
        python_loop()
        t2 = time.perf_counter()
        convolution()
        t3 = time.perf_counter()
        loop_ms.append(1000 * (t2 - t1))
        conv_ms.append(1000 * (t3 - t2))
        time.sleep(max(0.0, a.every_s - (t3 - t1)))
    for name, v in (("python loop", loop_ms), ("convolution", conv_ms)):
        v = sorted(v)
        slow = sum(x > 1.5 * v[0] for x in v) / len(v)
        print(f"{name:<12} n={len(v)} min {v[0]:.1f} ms  median {statistics.median(v):.1f}  "
              f"p90 {v[int(0.9 * (len(v) - 1))]:.1f}  max {v[-1]:.1f}  slower than 1.5x min: {slow:.0%}")


if __name__ == "__main__":
    main()
