"""Training throughput: elasticyolo's single-process training vs Ultralytics' own trainer, on the
same generated data, model, imgsz, batch, workers and cache, in one run.

Each system trains in a fresh subprocess (so neither inherits the other's threads or caches):
- elasticyolo: `TrainCore` + `TrainingLoop` with `workers=W` (and, for comparison, `workers=0`);
  on a GPU its model's forward and backward replay as CUDA graphs (`train/graphs.py`) unless
  `--cuda-graphs false`; `--eager-too` also runs it without them, to show what they give;
- Ultralytics: `YOLO(model).train(...)` with its defaults apart from the shared settings
  (`val=False`, `plots=False` too, so no per-epoch validation or plotting on either side);
- the data path alone: elasticyolo's loader with `workers=W` and `workers=0`, batches pulled
  along the sampler's plan and dropped, no model step.
Steady state: the first epoch is warm-up (process start, loader start, caching); images/s is
measured over the later epochs, each from its start to its last batch (epoch-end work such as
Ultralytics' last.pt save is left out of both). The data-wait share is the time the training
step spent waiting for its batch, over the same window (Ultralytics: from the end of one batch
to the start of the next).

Offline: Ultralytics' trainer checks AMP by downloading yolo11n.pt; like an offline user we
skip that check (Ultralytics itself keeps amp=True when the download fails), and it reads
results.csv with polars, which is not installed here, when it saves last.pt: that read is
replaced by an empty dict. Both are printed in the output.

    .venv/bin/python bench/throughput.py --device cpu --imgsz 320 --batch 8 --workers 2 --epochs 3
    .venv/bin/python bench/throughput.py --device cpu --imgsz 320 --batch 8 --workers 2 --epochs 3 \
        --images 256 --repeat 3 --skip-ultralytics  # the CPU targets' figures (64 images: 8 batches an epoch, noise)
    .venv/bin/python bench/throughput.py --device 0 --imgsz 640 --batch 16 --workers 8 --epochs 5 \
        [--cache ram] [--eager-too]

On a lent GPU machine, which lacks our packages, `bench/gpu_check.sh` runs it in one call.

`--data path/to/data.yaml` trains both systems on an existing dataset instead (generating 512
images at 640 px takes about a minute on one core, so a GPU check generates them once, in parallel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


# ---- the measured runs (each in its own process) ------------------------------------------------
def _spec(a: argparse.Namespace, workers: int, *extra: str, device: str | None = None) -> Any:
    """elasticyolo's job spec for a run: the shared settings, no validation."""
    from elasticyolo.spec import TrainSpec

    return TrainSpec.from_pairs([f"data={a.data}", f"model={a.model}", f"epochs={a.epochs}", f"imgsz={a.imgsz}",
                                 f"batch={a.batch}", f"workers={workers}", f"cache={a.cache}",
                                 f"device={device or a.device}", "val=false", *extra])


def run_elasticyolo(a: argparse.Namespace, workers: int, cuda_graphs: str | None = None) -> dict[str, Any]:
    import elasticyolo.train  # noqa: F401
    from elasticyolo.train.core import TrainCore, quiet_ultralytics
    from elasticyolo.train.loop import TrainingLoop

    quiet_ultralytics()
    spec = _spec(a, workers, *_graphs_pairs(cuda_graphs or a.cuda_graphs))
    core = TrainCore(spec, work_dir=Path(a.work) / f"ey-{workers}")
    marks: list[tuple[float, float, int]] = [(time.perf_counter(), 0.0, 0)]  # (t, data wait, images)

    def sink(rec: dict[str, Any]) -> None:
        if rec.get("epoch_ended"):
            marks.append((time.perf_counter(), core.data_wait_s, core.progress.epoch * core.sampler.num_samples))

    TrainingLoop(core, sinks=[sink]).run()
    used, graphs = core.loader.workers, core.forward.live
    core.close()
    import torch

    reserved = torch.cuda.max_memory_reserved(core.device) if core.device.type == "cuda" else 0
    return {**_summarize([(marks[i][0], marks[i + 1][0], marks[i + 1][1] - marks[i][1],
                           marks[i + 1][2] - marks[i][2]) for i in range(len(marks) - 1)], workers=used),
            "cuda_graphs": graphs, "gpu_reserved_gib": reserved / 2**30}


def run_elasticyolo_eager(a: argparse.Namespace, workers: int) -> dict[str, Any]:
    return run_elasticyolo(a, workers, cuda_graphs="false")


def _graphs_pairs(value: str) -> list[str]:
    return [] if value == "auto" else [f"cuda_graphs={value}"]


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def run_profile(a: argparse.Namespace, workers: int, cuda_graphs: str) -> dict[str, Any]:
    """Where a step's time goes on a GPU (torch.profiler over `--profile` optimizer steps after as
    many unprofiled ones): the share of wall time the GPU ran kernels, and launches per micro-batch."""
    import elasticyolo.train  # noqa: F401
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from elasticyolo.train.core import TrainCore, quiet_ultralytics

    quiet_ultralytics()
    core = TrainCore(_spec(a, workers, *_graphs_pairs(cuda_graphs)), work_dir=Path(a.work) / f"profile-{cuda_graphs}")

    def steps(n: int) -> int:
        micro = 0
        for _ in range(n):
            core.end_epoch_if_done()
            if core.finished:
                raise SystemExit(f"--profile {a.profile}: training ended first (raise --epochs)")
            micro += core.train_step().micro_batches
        return micro

    cuda = core.device.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(core.device)

    steps(a.profile)
    sync()
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        t0 = time.perf_counter()
        micro = steps(a.profile)
        sync()
        wall = time.perf_counter() - t0
    rows = prof.key_averages()
    busy_us = sum(r.self_device_time_total for r in rows if r.device_type == DeviceType.CUDA)
    launches = sum(r.count for r in rows if r.key in LAUNCHES)
    live = core.forward.live
    core.close()
    return {"gpu_busy": busy_us / 1e6 / wall, "launches_per_micro": launches / max(micro, 1),
            "ms_per_micro": 1000 * wall / max(micro, 1), "cuda_graphs": live}


def run_profile_graphs(a: argparse.Namespace, workers: int) -> dict[str, Any]:
    return run_profile(a, workers, "auto")


def run_profile_eager(a: argparse.Namespace, workers: int) -> dict[str, Any]:
    return run_profile(a, workers, "false")


def run_loader(a: argparse.Namespace, workers: int) -> dict[str, Any]:
    import elasticyolo.train  # noqa: F401
    from elasticyolo.train.core import TrainCore, quiet_ultralytics

    quiet_ultralytics()
    core = TrainCore(_spec(a, workers, device="cpu"), work_dir=Path(a.work) / f"loader-{workers}")
    s = core.sampler
    windows = []
    for _ in range(a.epochs):
        t0, w0 = time.perf_counter(), core.data_wait_s
        while not s.epoch_done():
            core.load_batch(s.shard(0, 1))
            s.advance(1)
        windows.append((t0, time.perf_counter(), core.data_wait_s - w0, s.num_samples))
        s.next_epoch()
    used = core.loader.workers
    core.close()
    return _summarize(windows, workers=used)


def run_ultralytics(a: argparse.Namespace, workers: int) -> dict[str, Any]:
    import elasticyolo.train  # noqa: F401  (offline settings for Ultralytics)
    import ultralytics.engine.trainer as trainer_mod
    from ultralytics import YOLO

    trainer_mod.check_amp = lambda *args, **kw: True  # offline: skip the yolo11n.pt download (amp stays on)
    trainer_mod.BaseTrainer.read_results_csv = lambda self: {}  # polars is not installed
    epoch_start: dict[int, float] = {}
    batches: dict[int, list[tuple[float, float]]] = {}
    last_end = [0.0]
    pending = [0.0]
    info: dict[str, Any] = {}

    def on_epoch_start(tr: Any) -> None:
        epoch_start[tr.epoch] = last_end[0] = time.perf_counter()

    def on_batch_start(tr: Any) -> None:
        pending[0] = time.perf_counter()

    def on_batch_end(tr: Any) -> None:
        now = time.perf_counter()
        batches.setdefault(tr.epoch, []).append((pending[0] - last_end[0], now))
        last_end[0] = now
        info["images"] = len(tr.train_loader.dataset)
        info["workers"] = tr.train_loader.num_workers

    model = YOLO(a.model)
    model.add_callback("on_train_epoch_start", on_epoch_start)
    model.add_callback("on_train_batch_start", on_batch_start)
    model.add_callback("on_train_batch_end", on_batch_end)
    model.train(data=a.data, epochs=a.epochs, imgsz=a.imgsz, batch=a.batch, workers=workers,
                cache=False if a.cache == "false" else a.cache, device=a.device if a.device != "auto" else None,
                val=False, plots=False, project=str(Path(a.work) / "ultralytics"), name="run", exist_ok=True,
                verbose=False)
    windows = [(epoch_start[e], b[-1][1], sum(w for w, _ in b), info["images"]) for e, b in sorted(batches.items())]
    return _summarize(windows, workers=info.get("workers", workers))


def _summarize(windows: list[tuple[float, float, float, int]], workers: int) -> dict[str, Any]:
    """windows: per epoch (start, end, data wait s, images). The first epoch is warm-up."""
    steady = windows[1:] or windows
    secs = sum(e - s for s, e, _, _ in steady)
    imgs = sum(n for *_, n in steady)
    return {"img_s": imgs / secs, "wait_share": sum(w for _, _, w, _ in steady) / secs, "workers": workers,
            "epochs": [round(n / (e - s), 2) for s, e, _, n in windows]}


RUNS = {"elasticyolo": run_elasticyolo, "elasticyolo-eager": run_elasticyolo_eager, "loader": run_loader,
        "ultralytics": run_ultralytics, "profile-graphs": run_profile_graphs, "profile-eager": run_profile_eager}


# ---- orchestration -----------------------------------------------------------------------------
def measure(a: argparse.Namespace, system: str, workers: int) -> dict[str, Any]:
    out = Path(a.work) / f"{system}-{workers}-{time.monotonic_ns()}.json"
    cmd = [sys.executable, __file__, "--run", system, "--run-workers", str(workers), "--run-out", str(out),
           "--data", str(a.data), "--work", a.work, "--model", a.model, "--device", a.device, "--imgsz", str(a.imgsz),
           "--batch", str(a.batch), "--epochs", str(a.epochs), "--cache", a.cache,
           "--cuda-graphs", a.cuda_graphs, "--profile", str(a.profile)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if proc.returncode != 0 or not out.exists():
        raise SystemExit(f"{system} workers={workers} failed:\n{proc.stdout[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="cpu, 0 (a CUDA device) or auto")
    ap.add_argument("--imgsz", type=int, default=None, help="default 320 on CPU, 640 on a GPU")
    ap.add_argument("--batch", type=int, default=None, help="default 8 on CPU, 16 on a GPU")
    ap.add_argument("--workers", type=int, default=None, help="default 2 on CPU, 8 on a GPU")
    ap.add_argument("--epochs", type=int, default=None, help="the first is warm-up; default 3 on CPU, 5 on a GPU")
    ap.add_argument("--images", type=int, default=None,
                    help="generated training images; default 64 on CPU, 512 on a GPU")
    ap.add_argument("--cache", default="false", choices=["false", "ram", "disk"])
    ap.add_argument("--model", default="yolov8n.yaml")
    ap.add_argument("--cuda-graphs", default="auto", choices=["auto", "true", "false"],
                    help="elasticyolo's cuda_graphs= (auto: on for CUDA)")
    ap.add_argument("--eager-too", action="store_true", help="also run elasticyolo with cuda_graphs=false")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="GPU: also profile STEPS optimizer steps of elasticyolo, with and without CUDA graphs "
                         "(GPU busy share, kernel launches per micro-batch)")
    ap.add_argument("--repeat", type=int, default=1, help="interleaved repeats of elasticyolo's runs (medians)")
    ap.add_argument("--skip-ultralytics", action="store_true")
    ap.add_argument("--skip-baselines", action="store_true", help="no workers=0 and loader-only runs")
    ap.add_argument("--run", choices=sorted(RUNS), help=argparse.SUPPRESS)
    ap.add_argument("--run-workers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--run-out", help=argparse.SUPPRESS)
    ap.add_argument("--data", help="an existing dataset YAML to train on instead of generated images")
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        result = RUNS[a.run](a, a.run_workers)
        Path(a.run_out).write_text(json.dumps(result))
        return

    import torch

    if a.device == "auto":
        a.device = "0" if torch.cuda.is_available() else "cpu"
    gpu = a.device != "cpu"
    a.imgsz = a.imgsz or (640 if gpu else 320)
    a.batch = a.batch or (16 if gpu else 8)
    a.workers = a.workers if a.workers is not None else (8 if gpu else 2)
    a.epochs = a.epochs or (5 if gpu else 3)
    a.images = a.images or (512 if gpu else 64)
    a.work = tempfile.mkdtemp(prefix="throughput-")
    from elasticyolo.data.synth import SynthSpec, write_dataset

    if a.data:
        from elasticyolo.data.yaml_check import load_data_yaml
        from elasticyolo.errors import UserError

        data_yaml = Path(a.data).resolve()
        try:
            load_data_yaml(str(data_yaml))  # a bad YAML fails here, in one line, before any run
        except UserError as exc:
            raise SystemExit(f"throughput: {exc}") from None
        a.data, source = str(data_yaml), f"dataset {data_yaml}"
    else:
        a.data = str(write_dataset(Path(a.work) / "data", SynthSpec(train=a.images, val=16, imgsz=a.imgsz, classes=3)))
        source = f"{a.images} generated images"
    where = torch.cuda.get_device_name(int(a.device)) if gpu else f"CPU ({len(os.sched_getaffinity(0))} cores)"
    print(f"throughput: {where}, {a.model}, imgsz {a.imgsz}, batch {a.batch}, workers {a.workers}, cache {a.cache}, "
          f"{source}, {a.epochs} epochs (the first is warm-up)", flush=True)

    ours: dict[int, list[dict[str, Any]]] = {}
    eager: list[dict[str, Any]] = []
    loader: dict[int, list[dict[str, Any]]] = {}
    worker_counts = [a.workers] + ([0] if not a.skip_baselines and a.workers != 0 else [])
    for _ in range(a.repeat):
        for w in worker_counts:
            ours.setdefault(w, []).append(measure(a, "elasticyolo", w))
        if a.eager_too:
            eager.append(measure(a, "elasticyolo-eager", a.workers))
        if not a.skip_baselines:
            for w in worker_counts:
                loader.setdefault(w, []).append(measure(a, "loader", w))
    ul = None if a.skip_ultralytics else measure(a, "ultralytics", a.workers)
    profiles = {k: measure(a, f"profile-{k}", a.workers) for k in ("graphs", "eager")} if a.profile and gpu else {}

    def med(rs: list[dict[str, Any]], k: str) -> float:
        return statistics.median(r[k] for r in rs)

    print(f"\n{'system':<34} {'workers':>8} {'img/s':>9} {'data wait':>10}  per epoch img/s")
    for name, rs in [*((f"elasticyolo TrainingLoop{' (graphs)' if rs[0]['cuda_graphs'] else ''}", rs)
                       for rs in ours.values()), *([("elasticyolo, cuda_graphs=false", eager)] if eager else [])]:
        print(f"{name:<34} {rs[0]['workers']:>8} {med(rs, 'img_s'):>9.2f} "
              f"{100 * med(rs, 'wait_share'):>9.2f}%  {[r['epochs'] for r in rs]}")
    if ul is not None:
        print(f"{'Ultralytics YOLO().train()':<34} {ul['workers']:>8} {ul['img_s']:>9.2f} "
              f"{100 * ul['wait_share']:>9.2f}%  {ul['epochs']}")
    for w, rs in loader.items():
        print(f"{'elasticyolo loader alone (no model)':<34} {rs[0]['workers']:>8} {med(rs, 'img_s'):>9.1f} "
              f"{'':>10}  {[r['epochs'] for r in rs]}")
    print()
    w = a.workers
    if ul is not None:
        note = ("" if gpu else "  (CPU: information only. Ultralytics trains on CPU with workers=0 and "
                f"torch threads = min(8, cpus - 1), its defaults)")
        print(f"elasticyolo / Ultralytics = {med(ours[w], 'img_s') / ul['img_s']:.3f}"
              f"{'  (target >= 1.0; >= 1.5 with --cache ram)' if gpu else ''}{note}")
        print("Ultralytics offline: AMP check skipped (amp stays on, as Ultralytics does when it cannot download "
              "yolo11n.pt); results.csv read replaced (polars is not installed)")
    print(f"elasticyolo CUDA graphs: {'replayed' if ours[w][0]['cuda_graphs'] else 'off (eager)'}")
    if eager:
        ratios = [x["img_s"] / y["img_s"] for x, y in zip(ours[w], eager)]
        print(f"elasticyolo / elasticyolo cuda_graphs=false = {statistics.median(ratios):.3f}"
              f"  per repeat {[round(r, 3) for r in ratios]}")
        if gpu:  # the graphs keep their activations' memory; an epoch's short last batch runs eagerly beside it
            print(f"elasticyolo peak GPU memory reserved: {med(ours[w], 'gpu_reserved_gib'):.2f} GiB, "
                  f"{med(eager, 'gpu_reserved_gib'):.2f} GiB with cuda_graphs=false")
    for k, pr in profiles.items():
        print(f"profile, {k}{'' if pr['cuda_graphs'] or k == 'eager' else ' (capture failed: eager)'}: "
              f"GPU busy {100 * pr['gpu_busy']:.1f}% of wall, {pr['launches_per_micro']:.0f} launches and "
              f"{pr['ms_per_micro']:.1f} ms per micro-batch ({a.profile} steps under torch.profiler)")
    print(f"elasticyolo data wait with workers={w}: {100 * med(ours[w], 'wait_share'):.2f}% of wall time"
          f"{'' if gpu else '  (target <= 1 % on CPU)'}")
    if 0 in ours and w:
        ratios = [x["img_s"] / y["img_s"] for x, y in zip(ours[w], ours[0])]
        print(f"elasticyolo workers={w} / workers=0 = {statistics.median(ratios):.3f}"
              f"{'' if gpu else '  (target >= 0.95 on CPU)'}  per repeat {[round(r, 3) for r in ratios]}")
    if 0 in loader and w:
        ratios = [x["img_s"] / y["img_s"] for x, y in zip(loader[w], loader[0])]
        print(f"loader alone workers={w} / workers=0 = {statistics.median(ratios):.3f}"
              f"{'' if gpu else '  (target >= 1.6 on CPU)'}  per repeat {[round(r, 3) for r in ratios]}")


if __name__ == "__main__":
    main()
