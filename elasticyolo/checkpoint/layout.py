"""Object layout and the manifest. No torch here: the CLI and the agent read manifests only.

    <root>/<job>/ckpt/<step:012d>-<stamp>-<id>.pt          one object per checkpoint
    <root>/<job>/manifests/<step:012d>-<stamp>-<id>.json   written only after the object verified
    <root>/<job>/latest.json                               copy of the newest landed manifest
    <root>/<job>/run/...                                   Ultralytics' run folder (results, best.pt)
    <root>/<job>/logs/<node>/...                           the agents' logs (agent/log_shipping.py)

Zero-padded steps make lexicographic listing order = training order. A manifest exists only for a
checkpoint whose upload completed and was verified, so a half-written object is never "a checkpoint".
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from elasticyolo.cluster.keys import check_job_name

FORMAT = 1


def check_job(job: str) -> str:
    """The job-name rule of the whole system (`cluster.keys`): a job checkpoints under the same
    name it runs under in etcd."""
    return check_job_name(job)


def ckpt_prefix(job: str) -> str:
    return f"{job}/ckpt/"


def manifest_prefix(job: str) -> str:
    return f"{job}/manifests/"


def latest_key(job: str) -> str:
    return f"{job}/latest.json"


def run_key(job: str, path: str) -> str:
    """Ultralytics' run folder of a cluster job, next to its checkpoints (never pruned):
    `<job>/run/{args.yaml, results.csv, results.png, timeline.png, timeline/*.jsonl, weights/best.pt,
    weights/last.pt, weights/epoch{N}.pt}`."""
    return f"{job}/run/{path}"


def new_name(step: int) -> str:
    return f"{step:012d}-{int(time.time() * 1000):013d}-{uuid.uuid4().hex[:8]}"


def object_key(job: str, name: str) -> str:
    return f"{ckpt_prefix(job)}{name}.pt"


def manifest_key(job: str, name: str) -> str:
    return f"{manifest_prefix(job)}{name}.json"


def name_of(key: str) -> str:
    """`job/manifests/<name>.json` or `job/ckpt/<name>.pt` -> `<name>`."""
    base = key.rsplit("/", 1)[-1]
    return base.rsplit(".", 1)[0]


def step_of(key: str) -> int | None:
    head = name_of(key).split("-", 1)[0]
    return int(head) if head.isdigit() else None


@dataclass
class Manifest:
    job: str
    key: str  # object key relative to the store root
    step: int  # optimizer steps since the start of the job
    epoch: int  # epoch in progress at the snapshot (0-based)
    epoch_step: int  # optimizer steps completed within that epoch
    epoch_end: bool
    world_size: int
    policy: str | None
    sha256: str
    size: int
    created: float  # unix seconds, when the upload landed
    reason: str = ""
    snapshot_s: float = 0.0  # training blocked this long
    upload_s: float = 0.0  # serialize + hash + upload + verify, in the background
    elasticyolo_version: str = ""
    ultralytics_version: str = ""
    torch_version: str = ""
    format: int = FORMAT
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return name_of(self.key)

    @property
    def manifest_key(self) -> str:
        return manifest_key(self.job, self.name)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True, indent=1).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> "Manifest":
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ValueError("manifest is not a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def summary(self) -> dict[str, Any]:
        """The fields status views show (JSON-able)."""
        return {"step": self.step, "epoch": self.epoch, "epoch_step": self.epoch_step, "size": self.size,
                "created": self.created, "age_s": max(0.0, time.time() - self.created),
                "upload_s": round(self.upload_s, 3), "snapshot_s": round(self.snapshot_s, 4),
                "key": self.key, "sha256": self.sha256, "world_size": self.world_size}
