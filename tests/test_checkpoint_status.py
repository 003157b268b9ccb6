"""`elasticyolo status` shows the last checkpoint: the checkpointer reports each landed
checkpoint to the progress sinks, and the etcd sink writes it where status reads it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.spec import TrainSpec
from elasticyolo.train.checkpointing import Checkpointer
from elasticyolo.train.core import TrainCore, quiet_ultralytics
from elasticyolo.worker_runtime.progress import EtcdProgress


def test_landed_checkpoint_reaches_status(tmp_path: Path, etcd_server: EtcdCluster, job_name: str) -> None:
    quiet_ultralytics()
    data = write_dataset(tmp_path / "d", SynthSpec(train=8, val=2, imgsz=64, classes=2))
    spec = TrainSpec.from_pairs([f"data={data}", "model=yolov8n.yaml", "epochs=1", "imgsz=64", "batch=4",
                                 f"checkpoint=file://{tmp_path / 'store'}", "val=false"])
    core = TrainCore(spec, work_dir=tmp_path / "run")
    sink = EtcdProgress(EtcdClient(etcd_server.endpoints), JobKeys(job_name))
    seen: list[dict] = []
    ckpt = Checkpointer(spec, job_name, rank=0, sinks=[sink, seen.append])
    core.train_step()
    assert ckpt.save_now(core, reason="test", timeout=60)
    ckpt.close()
    assert seen and seen[-1]["step"] == 1 and seen[-1]["uri"].startswith(f"file://{tmp_path / 'store'}")

    def shown() -> dict | None:
        out = subprocess.run([str(Path(sys.executable).with_name("elasticyolo")), "status", "--etcd",
                              etcd_server.endpoints, "--job", job_name, "--json"],
                             capture_output=True, text=True, timeout=30)
        view = json.loads(out.stdout)
        return view.get("last_checkpoint") if (view.get("last_checkpoint") or {}).get("step") == 1 else None

    last = wait_for(shown, 10, "status to show the checkpoint")
    assert last["epoch"] == 0 and last["size"] > 1_000_000
