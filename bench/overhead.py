"""Steps/s of elasticyolo's single-process training loop vs a plain Ultralytics DetectionModel loop.

Both train the same model architecture on the same generated data with the same optimizer, batch
and image size; they run interleaved step by step (A, B, A, B, ...) in one process so machine noise
hits both alike. Prints per-round figures and the median ratio (elasticyolo / plain).

`--workers` sets the data loader processes of both sides (elasticyolo's loader, a persistent
torch `DataLoader` for the plain loop); the default 0 loads in the process on both sides, so the
ratio is the cost of the loop itself.

    .venv/bin/python bench/overhead.py [--rounds 5 --steps 10 --imgsz 128 --batch 8 --workers 0]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import elasticyolo.train  # noqa: F401  (offline Ultralytics)
import torch

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.spec import TrainSpec
from elasticyolo.train.core import TrainCore, quiet_ultralytics
from elasticyolo.train.loop import TrainingLoop


class PlainLoop:
    """The baseline: what a user would write around Ultralytics' parts, no elasticity."""

    def __init__(self, core: TrainCore, workers: int) -> None:
        from ultralytics.engine.trainer import BaseTrainer
        from ultralytics.nn.tasks import DetectionModel
        from ultralytics.utils.torch_utils import ModelEMA

        spec = core.spec
        self.model = DetectionModel(cfg=spec.model, nc=core.data["nc"], ch=3, verbose=False)
        self.model.args = core.hyp
        self.dataset = core.train_set
        extra = dict(persistent_workers=True, multiprocessing_context="forkserver") if workers else {}
        self.loader = torch.utils.data.DataLoader(self.dataset, batch_size=spec.batch, shuffle=True,
                                                  num_workers=workers, collate_fn=self.dataset.collate_fn,
                                                  drop_last=True, **extra)
        shim = SimpleNamespace(args=core.hyp, data=core.data)
        self.optimizer = BaseTrainer.build_optimizer(shim, model=self.model, name=type(core.optimizer).__name__,
                                                     lr=spec.lr0, momentum=spec.momentum, decay=spec.weight_decay)
        self.ema = ModelEMA(self.model)
        self._it = iter(self.loader)

    def step(self) -> None:
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            batch = next(self._it)
        batch["img"] = batch["img"].float() / 255
        loss, _ = self.model(batch)
        loss.sum().backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=10.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.ema.update(self.model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--imgsz", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workers", type=int, default=0, help="data loader processes, both sides")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    quiet_ultralytics()
    tmp = Path(tempfile.mkdtemp(prefix="overhead-"))
    data = write_dataset(tmp / "data", SynthSpec(train=256, val=8, imgsz=args.imgsz, classes=3))
    # nbs = batch: one micro-batch per optimizer step in both loops; mosaic off in both.
    spec = TrainSpec.from_pairs([f"data={data}", "model=yolov8n.yaml", "epochs=1000", f"imgsz={args.imgsz}",
                                 f"batch={args.batch}", f"nbs={args.batch}", "close_mosaic=1000", "val=false",
                                 "optimizer=SGD", "warmup_epochs=0", f"workers={args.workers}"])
    core = TrainCore(spec, work_dir=tmp / "run")
    core.loader.wait_ready(120)
    plain = PlainLoop(core, args.workers)
    ours = TrainingLoop(core)

    def ours_steps(n: int) -> None:
        for _ in range(n):
            core.train_step()
            core.end_epoch_if_done()
            ours._emit({})

    for fn in (ours_steps, lambda n: [plain.step() for _ in range(n)]):  # warm up both
        fn(2)
    # Alternate single steps (A, B, A, B, ...) so load from other processes hits both sides alike.
    ratios = []
    print(f"{'round':>5} {'elasticyolo steps/s':>20} {'plain steps/s':>14} {'ratio':>7}")
    for r in range(args.rounds):
        t_ours = t_plain = 0.0
        for _ in range(args.steps):
            t = time.perf_counter()
            ours_steps(1)
            t_ours += time.perf_counter() - t
            t = time.perf_counter()
            plain.step()
            t_plain += time.perf_counter() - t
        a, b = args.steps / t_ours, args.steps / t_plain
        ratios.append(a / b)
        print(f"{r:>5} {a:>20.3f} {b:>14.3f} {a / b:>7.3f}")
    print(f"median ratio elasticyolo/plain = {statistics.median(ratios):.3f} "
          f"(imgsz {args.imgsz}, batch {args.batch}, workers {args.workers}, {args.steps} steps x {args.rounds} rounds, "
          f"target >= 0.97)")
    core.close()

if __name__ == "__main__":
    main()
