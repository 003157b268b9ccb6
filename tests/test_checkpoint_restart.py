"""Full restart from S3: train under real horovodrun with checkpoints to a real S3 API server
(moto on 127.0.0.1), kill every process, start again -> training resumes at the saved step."""

from __future__ import annotations

from pathlib import Path

import boto3
import psutil
import pytest
import torch

from elasticyolo.checkpoint import open_store, read_latest, restore_latest
from elasticyolo.data.synth import SynthSpec, write_dataset
from support.horovod_run import HorovodElasticJob
from elasticyolo.local_cluster.servers import S3Server
from elasticyolo.local_cluster.wait import wait_for

BUCKET = "ckpt-restart"


def test_kill_everything_then_resume_from_s3(tmp_path: Path, s3_server: S3Server,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    boto3.client("s3", endpoint_url=s3_server.endpoint_url).create_bucket(Bucket=BUCKET)
    uri = f"s3://{BUCKET}/jobs"
    data = write_dataset(tmp_path / "data", SynthSpec(train=32, val=8, imgsz=64, classes=2))
    # 30 epochs (240 steps): long enough that a checkpoint lands well before the end (uploads run
    # in a low-priority process and training is fast here).
    args = [f"data={data}", "model=yolov8n.yaml", "epochs=30", "imgsz=64", "batch=4", "nbs=4", "val=false",
            "close_mosaic=30", "warmup_epochs=1", "scale=0", "translate=0", f"checkpoint={uri}", "save_period_steps=3", "commit_every=1"]
    env = {**s3_server.env(), "ELASTICYOLO_JOB": "restart"}
    store = open_store(uri)

    (tmp_path / "run1").mkdir()
    first = HorovodElasticJob(tmp_path / "run1", ["localhost:1"], args, env=env).start()
    helpers: set[int] = set()
    try:
        first.wait_for(lambda: (m := read_latest(store, "restart")) is not None and m.step >= 9
                       and m.reason != "final" and m, 300, "a mid-training checkpoint at step >= 9 in S3")
        for pid in {e["pid"] for e in first.events()}:  # the workers' loader and uploader processes
            try:
                helpers |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
    finally:
        first.stop()  # SIGKILL horovodrun and every worker: nothing survives in memory
    wait_for(lambda: not any(_alive(p) for p in {e["pid"] for e in first.events()} | helpers), 20,
           "every worker and its helper processes gone")
    saved = read_latest(store, "restart")
    assert saved is not None
    ckpt, manifest = restore_latest(store, "restart")  # type: ignore[misc]
    assert manifest.step == saved.step
    from elasticyolo.train.digest import optimizer_state_digest, params_digest

    saved_opt = optimizer_state_digest(ckpt["optimizer"])
    saved_params = params_digest(model_from(ckpt))

    (tmp_path / "run2").mkdir()
    second = HorovodElasticJob(tmp_path / "run2", ["localhost:1"], args, env=env).start()
    try:
        # It resumed, trained on, and its own checkpoints land past the restored one (running the
        # remaining epochs to the end adds nothing a resume could get wrong).
        later = second.wait_for(lambda: (m := read_latest(store, "restart")) is not None
                                and m.step >= saved.step + 6 and m, 300, "a checkpoint of the resumed run")
    finally:
        second.stop()
    events = second.events()
    resume = next(e for e in events if e["ev"] == "resume")
    # An epoch-end checkpoint records the epoch it completed; training resumes in the next one.
    assert (resume["step"], resume["epoch"]) == (saved.step, saved.epoch + int(saved.epoch_end))
    # The loss curve continues from exactly the saved weights and optimizer state (the loss
    # itself is too noisy at this size to compare: augmentation draws differ between runs).
    assert resume["params_digest"] == pytest.approx(saved_params, rel=1e-9)
    assert resume["optimizer_digest"] == pytest.approx(saved_opt, rel=1e-9)
    steps = [e for e in events if e["ev"] == "step"]
    assert steps[0]["step"] == saved.step + 1  # continues right after the saved step
    assert [e["step"] for e in steps] == list(range(saved.step + 1, steps[-1]["step"] + 1))
    assert later.step <= steps[-1]["step"]


def model_from(ckpt: dict) -> torch.nn.Module:
    """The checkpoint's full-precision training weights in a fresh model of the same shape."""
    from ultralytics.nn.tasks import DetectionModel

    model = DetectionModel("yolov8n.yaml", nc=2, ch=3, verbose=False)
    model.load_state_dict(ckpt["elasticyolo"]["model"])
    return model


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
