"""The baseline of bench/ray_recovery.py: Ultralytics YOLO trained with Ray Train v2's
`TorchTrainer`, written as Ray's documentation shows a training function: the model wrapped by
`ray.train.torch.prepare_model` (DDP), the data loader by `prepare_data_loader` (a
DistributedSampler), a checkpoint at every epoch's end through `ray.train.report`, and a restart
resuming from `ray.train.get_checkpoint()`. Elastic: `ScalingConfig(num_workers=(min, max))`,
Ray's defaults otherwise (a failure restarts the worker group from the newest checkpoint; a
running group checks for room to grow every `elastic_resize_monitor_interval_s`, 60 s).

The model is Ultralytics' `DetectionModel` from a model yaml and its loss; the data its YOLO
dataset (`build_yolo_dataset`) and collate function; SGD with Ultralytics' momentum. The data
yaml is read by elasticyolo's reader (Ultralytics' `check_det_dataset` downloads a font).

Each worker appends its steps to `--trace` (JSONL, the fields elasticyolo's worker traces use:
`ev` step/resume/checkpoint, `t`, `step`, `world`, `rank`, `pid`), which is how the benchmark
times both systems alike. The driver (this script) runs `trainer.fit()` until it is killed:

    python bench/ray_train_yolo.py --address HOST:PORT --data DATA.yaml --trace DIR --storage DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def train_func(config: dict[str, Any]) -> None:
    import torch
    from torch.utils.data import DataLoader
    from ultralytics.cfg import get_cfg
    from ultralytics.data import build_yolo_dataset
    from ultralytics.nn.tasks import DetectionModel

    import ray.train
    import ray.train.torch
    from elasticyolo.data.yaml_check import load_data_yaml

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    trace = Path(config["trace"]) / f"trace-raytrain-{os.getpid()}.jsonl"

    def record(ev: str, **fields: Any) -> None:
        with open(trace, "a") as fh:
            fh.write(json.dumps({"ev": ev, "t": time.time(), "world": world, "rank": rank, "pid": os.getpid(),
                                 **fields}) + "\n")

    torch.manual_seed(0)
    data = load_data_yaml(config["data"])
    hyp = get_cfg(overrides={"model": config["model"], "data": data["yaml_file"], "imgsz": config["imgsz"],
                             "batch": config["batch"], "plots": False, "val": False, "verbose": False})
    model = DetectionModel(config["model"], nc=data["nc"], verbose=False)
    model.args = hyp  # the loss reads its gains from here
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    step, epoch = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as d:
            state = torch.load(Path(d) / "state.pt", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step, epoch = state["step"], state["epoch"] + 1
    record("resume", step=step, epoch=epoch, source="checkpoint" if checkpoint else "init")
    model = ray.train.torch.prepare_model(model)

    dataset = build_yolo_dataset(hyp, data["train"], config["batch"], data, mode="train", stride=32)
    loader = DataLoader(dataset, batch_size=config["batch"], shuffle=True, num_workers=0,
                        collate_fn=dataset.collate_fn)
    loader = ray.train.torch.prepare_data_loader(loader)

    while True:
        if ray.train.get_context().get_world_size() > 1:
            loader.sampler.set_epoch(epoch)
        for batch in loader:
            batch["img"] = batch["img"].float() / 255
            loss, _ = model(batch)  # DetectionModel.forward(dict) is its loss
            optimizer.zero_grad()
            loss.sum().backward()
            optimizer.step()
            step += 1
            record("step", step=step, epoch=epoch)
        with tempfile.TemporaryDirectory() as d:
            if rank == 0:
                module = model.module if hasattr(model, "module") else model
                torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                            "epoch": epoch}, Path(d) / "state.pt")
                ray.train.report({"step": step, "epoch": epoch}, checkpoint=ray.train.Checkpoint.from_directory(d))
            else:
                ray.train.report({"step": step, "epoch": epoch})
        record("checkpoint", step=step, epoch=epoch)
        epoch += 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--trace", required=True)
    ap.add_argument("--storage", required=True)
    ap.add_argument("--min-workers", type=int, default=1)
    ap.add_argument("--max-workers", type=int, default=2)
    ap.add_argument("--model", default="yolov8n.yaml")
    ap.add_argument("--imgsz", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--start-timeout", type=float, default=None,
                    help="RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (Ray's default: 60)")
    ap.add_argument("--resize-interval", type=float, default=60.0,
                    help="ScalingConfig(elastic_resize_monitor_interval_s) (Ray's default: 60)")
    ap.add_argument("--node-file", default=None, help="write the driver's Ray node id here (its controller's node)")
    args = ap.parse_args()
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")  # Ray Train v2 (the default in Ray 2.60 too)
    if args.start_timeout is not None:  # Ray Train hands it to its controller
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = f"{args.start_timeout:g}"
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    ray.init(address=args.address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    if args.node_file:
        Path(args.node_file).write_text(ray.get_runtime_context().get_node_id())
    trainer = TorchTrainer(
        train_func,
        train_loop_config={"data": args.data, "trace": args.trace, "model": args.model, "imgsz": args.imgsz,
                           "batch": args.batch},
        scaling_config=ScalingConfig(num_workers=(args.min_workers, args.max_workers), use_gpu=False,
                                     resources_per_worker={"CPU": 1},
                                     elastic_resize_monitor_interval_s=args.resize_interval),
        run_config=RunConfig(name="ray-train-yolo", storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=-1)),
    )
    trainer.fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
