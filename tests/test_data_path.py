"""The training data path end to end on real Ultralytics datasets: the loader's processes feed
`TrainCore`, `cache=ram|disk` keep decoded images as Ultralytics does, bad values are refused."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

pytest.importorskip("torch")

from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.errors import UserError  # noqa: E402
from elasticyolo.spec import TrainSpec  # noqa: E402
from support.pty import run_on_pty  # noqa: E402
from elasticyolo.train.core import TrainCore, quiet_ultralytics  # noqa: E402
from elasticyolo.train.loop import TrainingLoop  # noqa: E402


def spec_for(data: Path, *extra: str) -> TrainSpec:
    return TrainSpec.from_pairs([f"data={data}", "model=yolov8n.yaml", "epochs=2", "imgsz=64", "batch=4", "nbs=4",
                                 "warmup_epochs=0", "close_mosaic=1", *extra])


def test_cache_ram_trains_from_shared_memory_without_the_image_files(tmp_path: Path) -> None:
    """cache=ram: images are decoded and resized once, into one buffer the loader's processes
    share; training (two epochs, mosaic then closed mosaic, validation) then needs no image file,
    and the cached pixels are never modified by augmentation."""
    quiet_ultralytics()
    data = write_dataset(tmp_path / "d", SynthSpec(train=16, val=8, imgsz=64, classes=2))
    core = TrainCore(spec_for(data, "cache=ram", "workers=2"), work_dir=tmp_path / "run")
    try:
        assert core.loader.wait_ready(120) and core.loader.workers == 2
        cache = core.train_set.ims
        assert type(cache).__name__ == "_ImageCache" and cache.buffer.is_shared()
        digest = hashlib.sha256(cache.buffer.numpy().tobytes()).hexdigest()
        for img in (tmp_path / "d").rglob("*.png"):
            img.unlink()  # from now on, only the cache has the pixels
        summary = TrainingLoop(core).run()
        assert summary.steps > 0 and core.progress.epoch == 2 and len(core.progress.history) == 2
        assert core.loader.stats.inline == 0  # every batch came from the loader's processes
        assert hashlib.sha256(cache.buffer.numpy().tobytes()).hexdigest() == digest
    finally:
        core.close()


def test_cache_disk_writes_npy_files_and_trains_from_them(tmp_path: Path) -> None:
    quiet_ultralytics()
    data = write_dataset(tmp_path / "d", SynthSpec(train=8, val=4, imgsz=64, classes=2))
    core = TrainCore(spec_for(data, "cache=disk", "workers=1", "val=false"), work_dir=tmp_path / "run")
    try:
        npy = sorted((tmp_path / "d").rglob("*.npy"))
        assert len(npy) == 8 and core.train_set.cache == "disk"
        for img in (tmp_path / "d" / "images" / "train").glob("*.png"):
            shutil.move(img, img.with_suffix(".moved"))  # decoded copies on disk are enough
        assert TrainingLoop(core).run().steps > 0
    finally:
        core.close()


@pytest.mark.parametrize("pair,accepted", [("workers=-2", "whole number >= 0"), ("workers=two", "whole number >= 0"),
                                           ("cache=yes", "ram, disk or false")])
def test_bad_workers_or_cache_is_one_line_naming_the_accepted_values(pair: str, accepted: str) -> None:
    with pytest.raises(UserError) as err:
        TrainSpec.from_pairs(["data=x.yaml", pair])
    msg = str(err.value)
    assert "\n" not in msg and pair.split("=")[0] in msg and accepted in msg


def test_workers_default_as_ultralytics() -> None:
    from elasticyolo.train.loader import loader_workers

    assert TrainSpec.from_pairs(["data=x.yaml"]).workers == 8
    assert loader_workers(8, local_size=1) == min(8, len(__import__("os").sched_getaffinity(0)))
    assert loader_workers(8, local_size=10_000) == 0  # more slots than CPUs: load in the training process
    assert TrainSpec.from_pairs(["data=x.yaml", "cache=true"]).cache == "ram"


def test_train_at_a_terminal_shows_a_progress_bar(tmp_path: Path) -> None:
    """`elasticyolo train` run the way a person runs it: stderr is a terminal (a pty), so the
    progress bar is drawn; loader processes on."""
    import sys

    data = write_dataset(tmp_path / "d", SynthSpec(train=16, val=4, imgsz=64, classes=2))
    exe = Path(sys.executable).with_name("elasticyolo")
    rc, text = run_on_pty([str(exe), "train", "model=yolov8n.yaml", f"data={data}", "epochs=2", "imgsz=64",
                           "batch=8", "workers=2", "val=false"], timeout=300, cwd=tmp_path)
    assert rc == 0, text[-3000:]
    assert "epoch 2/2" in text and "32/32" in text and "done: epochs=2" in text, text[-3000:]
    # ... and leaves Ultralytics' run folder behind.
    assert "results saved to runs/detect/train" in text
    assert all((tmp_path / "runs" / "detect" / "train" / f).is_file()
               for f in ("results.csv", "results.png", "weights/best.pt"))


def test_a_batch_is_the_same_whichever_process_builds_it_and_however_often(tmp_path: Path) -> None:
    """Augmentation is seeded per sample: the loader's processes and the training process itself
    build identical batches, and a batch trained again after a rollback is the same batch.
    (Mosaic off: without cache=ram it draws from a buffer of recently loaded images.)"""
    import torch

    quiet_ultralytics()
    data = write_dataset(tmp_path / "d", SynthSpec(train=16, val=4, imgsz=64, classes=2))
    cores = [TrainCore(spec_for(data, f"workers={w}", "mosaic=0", "val=false"), work_dir=tmp_path / f"r{w}")
             for w in (2, 0)]
    try:
        assert cores[0].loader.wait_ready(120)
        s = cores[0].sampler

        def batch(core: TrainCore, consumed: int) -> dict:
            core.sampler.load_state_dict({"epoch": 0, "consumed": consumed})
            b = core.load_batch(core.sampler.shard(0, 1))
            assert b is not None
            return b

        first = [batch(cores[0], pos) for pos in range(0, 16, 4)]
        again = batch(cores[0], 4)  # a rollback to position 4: a replan, rebuilt by a worker
        inline = [batch(cores[1], pos) for pos in range(0, 16, 4)]
        assert cores[0].loader.stats.inline == 0 and cores[1].loader.stats.inline == 4
        assert torch.equal(again["img"], first[1]["img"]) and torch.equal(again["bboxes"], first[1]["bboxes"])
        for a, b in zip(first, inline):
            assert a["indices"] == b["indices"] and torch.equal(a["img"], b["img"])
        assert s.num_samples == 16
    finally:
        for c in cores:
            c.close()


def test_a_sample_is_augmented_the_same_at_any_world_size_rank_and_position(tmp_path: Path) -> None:
    """A sample's augmentation depends on (epoch, sample) only, mosaic included with cache=ram:
    an elastic run trains the images an uninterrupted run trains, whatever the world does."""
    import torch

    quiet_ultralytics()
    data = write_dataset(tmp_path / "d", SynthSpec(train=16, val=4, imgsz=64, classes=2))
    spec = spec_for(data, "workers=0", "cache=ram", "val=false", "close_mosaic=0")
    cores = {(r, w): TrainCore(spec, rank=r, world=w, work_dir=tmp_path / f"r{r}w{w}") for r, w in ((0, 1), (1, 2))}
    try:
        def images(core: TrainCore, consumed: int) -> dict[int, torch.Tensor]:
            core.sampler.load_state_dict({"epoch": 0, "consumed": consumed})
            b = core.load_batch(core.sampler.shard(core.rank, core.world))
            assert b is not None
            return dict(zip(b["indices"], b["img"]))

        alone = {**images(cores[(0, 1)], 4), **images(cores[(0, 1)], 8)}  # positions 4..11 at world 1
        rank1 = images(cores[(1, 2)], 4)  # rank 1's half of the step at position 4 at world 2
        assert rank1 and set(rank1) <= set(alone)
        for i, img in rank1.items():
            assert torch.equal(img, alone[i]), f"sample {i} augmented differently at world 2"
    finally:
        for c in cores.values():
            c.close()


def test_warm_up_leaves_no_trace_and_the_first_batch_is_the_planned_one(tmp_path: Path) -> None:
    """A pre-warmed worker's warm-up (`TrainCore.warm_up`: a batch from each loader process, a
    forward and backward pass) changes no weight, buffer or optimizer state, leaves no gradient
    and no loader counter, and the first real request still gets its own planned batch."""
    import torch

    quiet_ultralytics()
    data = write_dataset(tmp_path / "d", SynthSpec(train=16, val=4, imgsz=64, classes=2))
    core = TrainCore(spec_for(data, "workers=2", "mosaic=0", "val=false"), work_dir=tmp_path / "run")
    try:
        before = {k: v.clone() for k, v in core.model.state_dict().items()}
        core.warm_up()
        after = core.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(p.grad is None for p in core.model.parameters())
        assert not core.optimizer.state_dict()["state"]
        assert core.loader.stats.batches == 0 and core.data_wait_s == 0.0
        assert core.model.criterion is not None  # built by the warm-up pass, not the first step
        b = core.load_batch(core.sampler.shard(0, 1))
        assert b is not None and b["indices"] == core.sampler.shard(0, 1)
        assert core.loader.stats.inline == 0
    finally:
        core.close()
