"""The engine-neutral training core: one Ultralytics detector trained by our own loop.

Ultralytics' Trainer cannot run elastic (fixed world size, its own DDP launcher, rank-0-only
epoch-end saves), so we own the loop and reuse its parts: `DetectionModel`, the YOLO dataset and
augmentation, the detection loss, `BaseTrainer.build_optimizer`, `ModelEMA`, and
`DetectionValidator` for mAP. Engines (Horovod, torch elastic) supply `rank`, `world` and a
gradient all-reduce; everything else lives here.

Step semantics: one *step* is one optimizer step. It is made of `accumulate` micro-batches, each
consuming `world * batch` positions of the epoch's permutation (see `sampler.py`). The LR and
warmup are functions of (epoch, fraction of epoch done), so they do not depend on world size.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator, Sequence

import elasticyolo.train  # noqa: F401  (offline environment before Ultralytics loads)
import numpy as np
import torch
from torch import nn

from elasticyolo.data.yaml_check import load_data_yaml
from elasticyolo.spec import TrainSpec
from elasticyolo.train.loader import BatchLoader, LoaderStats, Request, loader_workers
from elasticyolo.train.loader_worker import CLOSED_MOSAIC
from elasticyolo.train.offline import disable_ultralytics_network
from elasticyolo.train.eager_step import compile_free_optimizers, eager_step
from elasticyolo.train.graphs import GraphedForward, wants_cuda_graphs
from elasticyolo.train.layout import apply_layout, wants_channels_last
from elasticyolo.train.policy import Scaling, resize_ramp, scaling_for
from elasticyolo.train.sampler import ElasticSampler
from elasticyolo.train.freeze import frozen_norm_names, frozen_prefixes, set_train_mode
from elasticyolo.train.weights import build_model

from ultralytics.cfg import get_cfg  # noqa: E402
from ultralytics.data import build_yolo_dataset  # noqa: E402
from ultralytics.engine.trainer import BaseTrainer  # noqa: E402
from ultralytics.utils import LOGGER  # noqa: E402
from ultralytics.utils.torch_utils import ModelEMA, one_cycle  # noqa: E402

disable_ultralytics_network()

GradAllreduce = Callable[[list[torch.Tensor]], None]
"""Averages the given gradient tensors across the world, in place."""


def no_allreduce(_: list[torch.Tensor]) -> None:
    return None


def pick_device(spec: TrainSpec, local_rank: int) -> torch.device:
    if spec.device in ("", "auto"):
        return torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if spec.device.isdigit():
        return torch.device(f"cuda:{spec.device}")
    return torch.device(spec.device)


@dataclass
class StepResult:
    loss_sum: torch.Tensor | float  # summed total loss of this rank's micro-batches, kept on the device
    images: int  # images this rank trained in the step
    micro_batches: int
    seconds: float
    # Ultralytics' loss components (box_loss, cls_loss, dfl_loss), summed over the micro-batches, on the device.
    loss_items: dict[str, torch.Tensor] = field(default_factory=dict)

    _host: list[float] | None = field(default=None, repr=False)

    def _read(self) -> list[float]:
        """The loss and its components in one device-to-host copy (one wait for the device per step)."""
        if self._host is None:
            parts = [self.loss_sum, *self.loss_items.values()]
            if isinstance(self.loss_sum, torch.Tensor):
                self._host = torch.stack([torch.as_tensor(p, device=self.loss_sum.device).float().reshape(())
                                          for p in parts]).tolist()
            else:
                self._host = [float(p) for p in parts]
        return self._host

    @property
    def loss(self) -> float:
        """Mean per-image loss. Reading it waits for the device: the loop does so once per step,
        never per micro-batch."""
        return self._read()[0] / max(self.images, 1)

    def loss_item_means(self) -> dict[str, float]:
        """Each loss component's mean over this step's micro-batches (Ultralytics' `loss_items`)."""
        n = max(self.micro_batches, 1)
        return {k: v / n for k, v in zip(self.loss_items, self._read()[1:])}


@dataclass
class Progress:
    """Everything that must survive a rollback or a restart besides model/optimizer/EMA."""

    epoch: int = 0
    consumed: int = 0
    step: int = 0  # optimizer steps since the start of the job
    lr_scale: float = 1.0  # applied LR scale (may be mid-ramp)
    ramp_from: float = 1.0  # scale at the last resize
    steps_since_resize: int = 1 << 30
    world: int = 0  # world size the scale was computed for
    optimizer_name: str = ""
    lr0: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)  # per-epoch metrics
    seconds: float = 0.0  # training + validation seconds of the committed work (results.csv "time")
    stopped: bool = False  # early stop (`patience` epochs without a better fitness)


# Each rank's own: its timing and its shard's train-loss means (history). Ranks at the same point of
# training differ only in these; a sync hands them rank 0's.
RANK_LOCAL_PROGRESS = ("seconds", "history")


def shared_progress(progress: dict[str, Any]) -> list[tuple[str, Any]]:
    """The part of a progress record that is equal on every rank at the same point of training."""
    return sorted((k, v) for k, v in progress.items() if k not in RANK_LOCAL_PROGRESS)


class TrainCore:
    def __init__(
        self,
        spec: TrainSpec,
        *,
        rank: int = 0,
        world: int = 1,
        local_rank: int = 0,
        grad_allreduce: GradAllreduce = no_allreduce,
        work_dir: str | Path | None = None,
        local_size: int | None = None,
    ) -> None:
        self.spec = spec
        self.rank, self.world, self.local_rank = rank, world, local_rank
        # Training processes on this node (they share its CPUs): from the engine's environment,
        # else the spec's slots (a warm worker builds its core before it has that environment).
        self.local_size = local_size or spec.slots
        if loader_workers(spec.workers, self.local_size) > 0:
            from elasticyolo.mp import start_fork_server

            start_fork_server()  # its imports overlap with building the model and datasets
        self.grad_allreduce = grad_allreduce
        self.device = pick_device(spec, local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.work_dir = Path(work_dir or "runs/elasticyolo")
        self.data = load_data_yaml(spec.data)
        torch.manual_seed(spec.seed)
        np.random.seed(spec.seed)

        overrides = spec.ultralytics_overrides()
        overrides.update(data=self.data["yaml_file"], model=spec.model, plots=False, val=spec.val, verbose=False)
        self.hyp = get_cfg(overrides=overrides)
        self.model = build_model(spec, self.data["nc"], self.data["names"]).to(self.device)
        # Frozen layers (freeze.py): no gradient, and their BatchNorm statistics stay.
        self.frozen_norms = frozen_norm_names(self.model, frozen_prefixes(spec.freeze, len(self.model.model)))
        # Before the EMA copy and the optimizer, which then follow the layout (layout.py).
        self.channels_last = wants_channels_last(self.device, spec.channels_last)
        if self.channels_last:
            apply_layout([self.model], True)
        self.model.args = self.hyp  # the loss reads box/cls/dfl gains from here
        # Walked once: model.parameters() walks the module tree (about 0.5 ms for yolov8n), and a
        # layout change keeps the Parameter objects.
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.stride = max(int(self.model.stride.max()), 32)

        self.train_set = build_yolo_dataset(self.hyp, self.data["train"], spec.batch, self.data, mode="train",
                                            stride=self.stride)
        # Built up front when validation is on, so the loader's processes hold it too.
        self.val_set: Any = self._build_val_set() if spec.val else None
        self.sampler = ElasticSampler(len(self.train_set), spec.batch, seed=spec.seed)
        datasets = {"train": self.train_set, **({"val": self.val_set} if self.val_set is not None else {})}
        self.loader = BatchLoader(datasets, self.hyp, loader_workers(spec.workers, self.local_size),
                                  device=self.device, seed=spec.seed)  # + each request's key: see BatchBuilder
        self._val_runs = 0
        self.amp = bool(spec.amp and self.device.type == "cuda")
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp)
        # The model's training forward (and so its backward): CUDA graphs for full micro-batches.
        self.forward = GraphedForward(self.model, enabled=wants_cuda_graphs(self.device, spec.cuda_graphs),
                                      amp=self.amp, shape=(spec.batch, 3, spec.imgsz, spec.imgsz))

        # Optimizer chosen once for the reference world (so it never changes on a resize).
        base = scaling_for(spec.policy, spec.ref_world, batch=spec.batch, nbs=spec.nbs, ref_world=spec.ref_world)
        iterations = math.ceil(len(self.train_set) / max(spec.batch * spec.ref_world, spec.nbs)) * spec.epochs
        shim = SimpleNamespace(args=self.hyp, data=self.data)
        compile_free_optimizers()  # neither this nor the steps import torch._dynamo (train/eager_step.py)
        self.optimizer = BaseTrainer.build_optimizer(
            shim, model=self.model, name=spec.optimizer, lr=spec.lr0, momentum=spec.momentum,
            decay=self._decay(base), iterations=iterations,
        )
        eager_step(self.optimizer)
        for g in self.optimizer.param_groups:
            g.setdefault("initial_lr", g["lr"])
        self.lf: Callable[[float], float] = (
            one_cycle(1, self.hyp.lrf, spec.epochs) if spec.cos_lr
            else (lambda x: max(1 - x / spec.epochs, 0) * (1.0 - self.hyp.lrf) + self.hyp.lrf)
        )
        self.ema = ModelEMA(self.model)
        self.progress = Progress(optimizer_name=type(self.optimizer).__name__, lr0=self.optimizer.param_groups[0]["initial_lr"])
        self.scaling: Scaling = base
        self.set_world(world, rank)

    # ---- world size and policy -------------------------------------------------------------
    def _decay(self, scaling: Scaling) -> float:
        """Ultralytics scales weight decay with the batch per optimizer step."""
        return self.spec.weight_decay * scaling.global_batch / self.spec.nbs

    def set_world(self, world: int, rank: int) -> None:
        """Apply the rescaling policy for a (possibly new) world size. Called at start, after every
        reset and after restoring state; a change of size starts the LR ramp."""
        self.world, self.rank = world, rank
        new = scaling_for(self.spec.policy, world, batch=self.spec.batch, nbs=self.spec.nbs, ref_world=self.spec.ref_world)
        p = self.progress
        if p.world and p.world != world:
            p.ramp_from = p.lr_scale
            p.steps_since_resize = 0
        elif not p.world:
            p.ramp_from = new.lr_scale
        p.world = world
        self.scaling = new
        for g in self.optimizer.param_groups:
            if g.get("param_group") in ("weight", "muon"):
                g["weight_decay"] = self._decay(new)

    def current_lr_scale(self) -> float:
        p = self.progress
        return resize_ramp(p.ramp_from, self.scaling.lr_scale, p.steps_since_resize, self.spec.resize_warmup_steps)

    # ---- LR schedule (Ultralytics' warmup + lambda schedule) --------------------------------
    def _warmup_fraction(self) -> float | None:
        """Fraction of warmup done, or None once warmup is over. Ultralytics keeps the last epoch
        out of warmup."""
        warm_epochs = min(self.spec.warmup_epochs, max(self.spec.epochs - 1, 0))
        if warm_epochs <= 0:
            return None
        done = self.progress.epoch + self.sampler.state.consumed / self.sampler.num_samples
        frac = done / warm_epochs
        return frac if frac <= 1.0 else None

    def apply_schedule(self) -> tuple[float, int]:
        """Set every param group's LR/momentum for the next step; return (lr of group 0, accumulate)."""
        scale = self.current_lr_scale()
        self.progress.lr_scale = scale
        epoch_factor = self.lf(self.progress.epoch)
        warm = self._warmup_fraction()
        acc = self.scaling.accumulate
        for g in self.optimizer.param_groups:
            target = g["initial_lr"] * epoch_factor * scale
            if warm is not None:
                start = self.hyp.warmup_bias_lr if g.get("param_group") == "bias" else 0.0
                g["lr"] = float(np.interp(warm, [0, 1], [start, target]))
                if "momentum" in g:
                    g["momentum"] = float(np.interp(warm, [0, 1], [self.hyp.warmup_momentum, self.hyp.momentum]))
            else:
                g["lr"] = target
                if "momentum" in g:
                    g["momentum"] = self.hyp.momentum
        if warm is not None:
            acc = max(1, int(np.interp(warm, [0, 1], [1, acc]).round()))
        return self.optimizer.param_groups[0]["lr"], acc

    # ---- data ------------------------------------------------------------------------------
    def _build_val_set(self) -> Any:
        # As Ultralytics' validator builds it: rect batches of 2 x batch.
        return build_yolo_dataset(self.hyp, self.data["val"], self.spec.batch * 2, self.data, mode="val",
                                  stride=self.stride)

    def mosaic_closed(self, epoch: int) -> bool:
        """Ultralytics closes mosaic for the last `close_mosaic` epochs."""
        return epoch >= self.spec.epochs - self.spec.close_mosaic

    def _train_plan(self, epoch: int, start: int) -> Iterator[Request]:
        """The loader's requests from (epoch, start) on, for this rank and world."""
        rank, world = self.rank, self.world
        for shard in self.sampler.plan(rank, world, epoch, start, self.spec.epochs):
            # A sample's augmentation depends on (epoch, sample) only: the same at any world size,
            # rank or position, and again after a rollback (loader_worker.BatchBuilder).
            yield Request((shard.epoch, shard.start, world, rank), "train", tuple(shard.indices),
                          CLOSED_MOSAIC if self.mosaic_closed(shard.epoch) else "", seed_key=("train", shard.epoch))

    def load_batch(self, indices: Sequence[int]) -> dict[str, Any] | None:
        """The batch of this rank's shard at the sampler's position (prefetched by the loader)."""
        epoch, start = self.sampler.state.epoch, self.sampler.state.consumed
        batch = self.loader.get("train", (epoch, start, self.world, self.rank), lambda: self._train_plan(epoch, start))
        if batch is not None and batch["indices"] != list(indices):
            raise RuntimeError(f"loader returned samples {batch['indices'][:4]}... for shard {list(indices)[:4]}...")
        return batch

    @property
    def data_wait_s(self) -> float:
        """Seconds the training steps spent obtaining batches (waiting for the loader or building them)."""
        return self.loader.stats.wait_s.get("train", 0.0)

    def preprocess(self, batch: dict[str, Any]) -> dict[str, Any]:
        # Pinned batches (CUDA, workers > 0) copy asynchronously; nothing here waits for the device.
        non_blocking = self.device.type == "cuda"
        for k, v in batch.items():
            if isinstance(v, torch.Tensor):
                batch[k] = v.to(self.device, non_blocking=non_blocking)
        batch["img"] = batch["img"].float().div_(255)
        return batch

    def train_mode(self, model: nn.Module | None = None) -> None:
        """Put `model` (default: the trained one) in training mode, its frozen layers' BatchNorm
        modules in eval mode, as Ultralytics' trainer does every epoch."""
        set_train_mode(model or self.model, self.frozen_norms)

    def close(self) -> None:
        """Stop the loader's processes (they also stop when this process exits)."""
        self.loader.close()

    # ---- one optimizer step ----------------------------------------------------------------
    def train_step(self, before_sync: Callable[[list[int], "StepResult"], None] | None = None) -> StepResult:
        """Run `accumulate` micro-batches (fewer at the end of an epoch), all-reduce the gradients,
        clip, step, update EMA. Advances the sampler and `progress.step`.

        `before_sync(indices, partial_result)` runs after the local work and before the gradient
        all-reduce: a step whose all-reduce completed anywhere has been reported by every rank."""
        t0 = time.perf_counter()
        if not self.model.training:  # train() walks every module: 2 ms a step for yolov8n
            self.train_mode()
        _, acc = self.apply_schedule()
        loss_sum = torch.zeros((), device=self.device)  # stays on the device: no sync per micro-batch
        images, micro = 0, 0
        items_sum: dict[str, torch.Tensor] = {}
        step_indices: list[int] = []
        while micro < acc and not self.sampler.epoch_done():
            indices = self.sampler.shard(self.rank, self.world)
            batch = self.load_batch(indices)
            if batch is not None:
                step_indices.extend(batch["indices"])  # what was really loaded, for the trace
                batch = self.preprocess(batch)
                with torch.autocast(self.device.type, enabled=self.amp):
                    loss, items = self.model.loss(batch, self.forward(batch["img"]))
                    # Ultralytics: the loss is summed over images; multiplying by the world size
                    # makes the averaging all-reduce a sum over the global batch, as with its DDP.
                    loss = loss.sum() * self.world
                self.scaler.scale(loss).backward()
                loss_sum += loss.detach().float() / self.world
                for k, v in _loss_dict(items).items():
                    items_sum[k] = items_sum[k] + v.float() if k in items_sum else v.float()
                images += len(indices)
            self.sampler.advance(self.world)
            micro += 1
        if before_sync is not None:
            before_sync(step_indices, StepResult(loss_sum, images, micro, time.perf_counter() - t0))
        self._optimizer_step()
        p = self.progress
        p.step += 1
        p.steps_since_resize += 1
        p.consumed = self.sampler.state.consumed
        return StepResult(loss_sum, images, micro, time.perf_counter() - t0, items_sum)

    def _optimizer_step(self) -> None:
        grads = []
        for param in self.trainable:
            if param.grad is None:  # a rank with an empty shard contributes zeros
                param.grad = torch.zeros_like(param)
            grads.append(param.grad)
        self.grad_allreduce(grads)
        self.scaler.unscale_(self.optimizer)
        torch.nn.utils.clip_grad_norm_(self.trainable, max_norm=10.0)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=not self.forward.live)  # a graph adds into existing gradients
        self.ema.update(self.model)

    def warm_up(self) -> None:
        """For a process about to join a world: one batch from each loader process, and one
        forward and backward pass on a synthetic batch (on a GPU it captures the CUDA graphs).

        A process's first step pays one-off costs (the loader processes' first batch, the loss's
        lazily built criterion, first-use kernels and allocations: 0.1-0.25 s at imgsz 64 on a
        CPU) that the running world would otherwise wait for at a join. Leaves nothing behind:
        the warm-up batches are keyed apart from any plan (the first real request replans), the
        loader's counters are reset, the BatchNorm buffers put back and the gradients dropped; no
        optimizer step, no sampler state touched."""
        if self.loader.workers > 0 and self.loader.wait_ready(timeout=300):
            indices = tuple(range(min(self.spec.batch, len(self.train_set))))
            requests = [Request(("warm-up", i), "train", indices) for i in range(self.loader.depth)]
            for r in requests:
                self.loader.get("train", r.key, lambda: iter(requests))
            self.loader.stats = LoaderStats()
        n, size = self.spec.batch, self.spec.imgsz
        buffers = {name: b.detach().clone() for name, b in self.model.named_buffers()}
        batch = {
            "img": torch.zeros(n, 3, size, size, device=self.device),  # as after preprocess()
            "batch_idx": torch.arange(n, dtype=torch.float32, device=self.device),  # one box per image
            "cls": torch.zeros(n, 1, device=self.device),
            "bboxes": torch.tensor([[0.5, 0.5, 0.25, 0.25]], device=self.device).repeat(n, 1),
        }
        self.train_mode()
        with torch.autocast(self.device.type, enabled=self.amp):
            loss, _ = self.model.loss(batch, self.forward(batch["img"]))  # captures the CUDA graphs
        loss.sum().backward()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, b in self.model.named_buffers():
                b.copy_(buffers[name])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def end_epoch_if_done(self) -> bool:
        """If the epoch's samples are all trained, move to the next epoch. Returns True if it did."""
        if not self.sampler.epoch_done():
            return False
        self.sampler.next_epoch()
        self.progress.epoch = self.sampler.state.epoch
        self.progress.consumed = 0
        return True

    @property
    def finished(self) -> bool:
        return self.progress.epoch >= self.spec.epochs or self.progress.stopped

    def sync_sampler_from_progress(self) -> None:
        """After a rollback/restore the progress record is the truth."""
        self.sampler.load_state_dict({"epoch": self.progress.epoch, "consumed": self.progress.consumed})

    # ---- validation ------------------------------------------------------------------------
    def validate(self, model: nn.Module | None = None,
                 gather: Callable[[Any], list[Any]] | None = None) -> dict[str, float]:
        """mAP50 and mAP50-95 of the EMA model on the val split.

        With `gather` (an all-gather of a Python object across the world), every rank validates its
        share of the val batches and the match statistics are merged, so the whole world
        validates together: no rank sits in a collective while rank 0 validates alone (that wait
        can outlast Gloo's timeout). Ultralytics' own DDP gather path expects torch.distributed,
        so the validator is driven batch by batch here, with batches from the parallel loader."""
        from ultralytics.models.yolo.detect import DetectionValidator

        model = model or self.ema.ema
        args = get_cfg(overrides=dict(self.hyp.__dict__, mode="val", plots=False, save_json=False, half=False))
        validator = DetectionValidator(save_dir=self.work_dir / "val", args=args)
        validator.device = self.device
        validator.data = self.data
        validator.training = False
        validator.stride = self.stride
        validator.names = self.data["names"]
        if self.val_set is None:  # validation was off at start: build it here, load it in this process
            self.val_set = self._build_val_set()
            self.loader.add_local("val", self.val_set)
        dataset = self.val_set
        bs = self.spec.batch * 2
        validator.dataloader = SimpleNamespace(dataset=dataset, sampler=range(len(dataset)), batch_size=bs)
        rank, world = (self.rank, self.world) if gather is not None else (0, 1)
        self._val_runs += 1
        mine = [Request(("val", self._val_runs, lo), "val", tuple(range(lo, hi)))
                for lo, hi in val_batches(len(dataset), bs, rank, world)]
        was_training = model.training
        model.eval()
        validator.init_metrics(model)
        # Validation losses as Ultralytics' validator computes them during training (summed per batch).
        loss_sums: dict[str, float] = {}
        with torch.inference_mode():
            for i, req in enumerate(mine):
                batch = self.loader.get("val", req.key, lambda i=i: iter(mine[i:]))
                assert batch is not None
                batch = validator.preprocess(batch)
                batch["img"] = batch["img"].float()
                preds = model(batch["img"])
                for k, v in _loss_dict(model.loss(batch, preds)[1]).items():
                    loss_sums[k] = loss_sums.get(k, 0.0) + float(v)
                validator.update_metrics(validator.postprocess(preds), batch)
        if was_training:
            self.train_mode(model)
        n_batches = len(mine)
        if gather is not None and world > 1:
            merged: dict[str, list[Any]] = {k: [] for k in validator.metrics.stats}
            parts = gather((validator.metrics.stats, loss_sums, len(mine)))
            loss_sums, n_batches = {}, 0
            for part, part_losses, part_batches in parts:
                for k, v in part.items():
                    merged[k].extend(v)
                for k, v in part_losses.items():
                    loss_sums[k] = loss_sums.get(k, 0.0) + v
                n_batches += part_batches
            validator.metrics.stats = merged
            validator.metrics.box.clear_image_metrics()  # per-image extras are not needed for mAP
        stats = validator.get_stats()
        return {
            "mAP50": float(stats.get("metrics/mAP50(B)", 0.0)),
            "mAP50-95": float(stats.get("metrics/mAP50-95(B)", 0.0)),
            "precision": float(stats.get("metrics/precision(B)", 0.0)),
            "recall": float(stats.get("metrics/recall(B)", 0.0)),
            **{f"val/{k}": v / max(n_batches, 1) for k, v in loss_sums.items()},
        }


def _loss_dict(items: Any) -> dict[str, torch.Tensor]:
    """Ultralytics' loss components by name (8.4 returns a dict; older releases a tensor of box, cls, dfl)."""
    if isinstance(items, dict):
        return {str(k): v.detach() for k, v in items.items()}
    return {name: v for name, v in zip(("box_loss", "cls_loss", "dfl_loss"), items.detach().reshape(-1))}


def val_batches(n: int, bs: int, rank: int, world: int) -> list[tuple[int, int]]:
    """Rank `rank`'s validation batches as [lo, hi) ranges: a contiguous, balanced share of the
    (aspect-ratio sorted) val set, cut at Ultralytics' rect batch boundaries so the images of one
    batch share a letterbox shape."""
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    hi = lo + base + (1 if rank < extra else 0)
    out = []
    while lo < hi:
        end = min(hi, (lo // bs + 1) * bs)
        out.append((lo, end))
        lo = end
    return out


def quiet_ultralytics() -> None:
    import logging

    LOGGER.setLevel(logging.WARNING)
