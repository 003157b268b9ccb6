"""The training job spec: what to train and how to stay elastic.

Used by `elasticyolo train` (single process), `elasticyolo submit` (stored in etcd) and by
workers. Option names follow Ultralytics where they exist (lr0, lrf, nbs, close_mosaic, ...).
No torch here: the CLI and the agent validate specs too.
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterable, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from elasticyolo.engines.names import BUILTIN as BUILTIN_ENGINES, DEFAULT as DEFAULT_ENGINE
from elasticyolo.errors import UserError
from elasticyolo.s3options import S3Settings

# Ultralytics augmentation / loss-gain keys passed through to `get_cfg` unchanged.
ULTRALYTICS_PASSTHROUGH = (
    "hsv_h", "hsv_s", "hsv_v", "degrees", "translate", "scale", "shear", "perspective",
    "flipud", "fliplr", "mosaic", "mixup", "copy_paste", "box", "cls", "dfl",
)


class TrainSpec(S3Settings):
    """One training job. Every field can be given as `key=value` on the command line.
    `s3_*` (from S3Settings): endpoint, region, profile and server-side encryption for the
    checkpoint store and an `s3://` dataset."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # What to train (Ultralytics meanings).
    model: str = "yolov8n.yaml"
    data: str = Field(..., description="data.yaml: a path on the nodes, or s3://bucket/prefix/data.yaml (staged)")
    epochs: int = Field(10, ge=1)
    imgsz: int = Field(640, ge=32)
    batch: int = Field(16, ge=1, description="images per worker per step")
    optimizer: Literal["auto", "SGD", "Adam", "AdamW", "NAdam", "RAdam", "RMSProp"] = "auto"
    lr0: float = Field(0.01, gt=0)
    lrf: float = Field(0.01, gt=0)
    momentum: float = Field(0.937, ge=0, lt=1)
    weight_decay: float = Field(0.0005, ge=0)
    warmup_epochs: float = Field(3.0, ge=0)
    warmup_momentum: float = Field(0.8, ge=0, lt=1)
    warmup_bias_lr: float = Field(0.1, ge=0)
    nbs: int = Field(64, ge=1, description="nominal batch size")
    cos_lr: bool = False
    close_mosaic: int = Field(10, ge=0)
    seed: int = 0
    workers: int = Field(8, description="data loader processes per training process, at most the CPUs per slot; "
                                        "0 loads in the training process")
    cache: Literal["ram", "disk", "false"] = Field("false", description="keep decoded, resized images: ram, disk or false")
    amp: bool = True
    channels_last: bool | None = Field(None, description="train in NHWC memory layout; unset: on for CUDA, as "
                                                         "Ultralytics (about half the GPU time of NCHW)")
    cuda_graphs: bool | None = Field(None, description="replay the model's forward and backward as CUDA graphs "
                                                       "(fewer kernel launches per step); unset: on for CUDA")
    device: str = ""
    val: bool = True
    hyp: dict[str, float] = Field(default_factory=dict, description="Ultralytics augmentation/loss keys")

    # Fine-tuning (Ultralytics' meanings).
    pretrained: str | None = Field(None, description=(
        "weights to start from: a .pt path or s3://bucket/key.pt, whose matching tensors transfer into model= "
        "(a .yaml, or a .pt's architecture); false: a .pt model='s architecture from random weights; "
        "unset or true: a .pt model='s own weights"))
    freeze: int | list[int | str] | None = Field(None, description=(
        "layers kept as loaded: N (layers 0..N-1) or a list of layer indices (0,1,2 or [0,1,2]; a name such as "
        "22.cv2 for part of one); their BatchNorm statistics stay too"))

    # Elasticity.
    engine: str = Field(DEFAULT_ENGINE, description=f"{', '.join(BUILTIN_ENGINES)}, or a registered engine "
                                                    "(engines/registry.py)")
    policy: Literal["linear", "constant_global_batch"] = "linear"
    ref_world: int = Field(1, ge=1, description="world size lr0 (and the global batch) is tuned for")
    resize_warmup_steps: int = Field(20, ge=0, description="LR ramp after a resize (linear policy)")
    commit_every: int = Field(0, ge=0, description="optimizer steps between commits, for every engine; 0 = about "
                                                    "the engine's commit_target_s seconds of work (docs/engines.md)")
    min_nodes: int = Field(1, ge=1)
    max_nodes: int | None = Field(None, ge=1)
    slots: int = Field(1, ge=1, description="workers per node")
    fp16_allreduce: bool = False
    reset_limit: int | None = Field(None, ge=1)
    cooldown_s: tuple[int, int] = (5, 30)
    gloo_timeout_s: int = Field(30, ge=1)
    elastic_timeout_s: int = Field(600, ge=1)

    # Run outputs and model selection (Ultralytics' meanings).
    project: str | None = Field(None, description="parent of `elasticyolo train`'s run folder: unset runs/detect, "
                                                  "a relative path under runs/detect, an absolute one as is "
                                                  "(`run_layout.py`; a cluster job's folder is in its store)")
    name: str | None = Field(None, description="run folder name (default: the job name; also where `checkpoints "
                                               "download --run` puts a cluster job's); an existing one gets -2, "
                                               "-3, ... appended unless exist_ok")
    exist_ok: bool = False
    patience: int = Field(100, ge=0, description="stop after this many epochs without a better fitness (0: never)")
    save_period: int = Field(-1, description="also keep weights/epoch{N}.pt every N epochs (< 1: off)")
    resume: str | None = Field(None, description="true (the newest run's weights/last.pt) or a last.pt path "
                                                 "(`elasticyolo train`; cluster jobs resume from checkpoint=)")

    # Checkpoints.
    checkpoint: str | None = Field(None, description="store URI: s3://bucket/prefix or file:///path")
    save_period_steps: int = Field(200, ge=0)
    save_period_s: float = Field(300.0, ge=0)
    keep_last: int = Field(3, ge=1)
    keep_epochs: bool = False
    checkpoint_nice: int = Field(19, ge=0, le=19, description=(
        "CPU priority (nice) of the background upload: 19 runs it only on CPU time training leaves "
        "(SCHED_IDLE), so where training keeps every CPU busy a checkpoint can wait minutes; lower "
        "values land it sooner at training's expense"))

    @field_validator("model")
    @classmethod
    def _model_known(cls, v: str) -> str:
        from elasticyolo.models import check_model_name

        return check_model_name(v)

    @field_validator("pretrained", mode="before")
    @classmethod
    def _pretrained(cls, v: Any) -> str | None:
        text = "" if v is None else str(v).strip()
        if text.lower() in ("", "none", "null"):
            return None
        if text.lower() in ("true", "1", "yes", "false", "0", "no"):
            return "true" if text.lower() in ("true", "1", "yes") else "false"
        from elasticyolo.models import WEIGHTS_HELP, check_weights_source

        if not text.endswith(".pt"):
            raise ValueError(f"{text!r} is not a weights file: expected {WEIGHTS_HELP}, true or false")
        return check_weights_source(text)

    @field_validator("freeze", mode="before")
    @classmethod
    def _freeze(cls, v: Any) -> int | list[int | str] | None:
        return parse_freeze(v)

    @field_validator("engine")
    @classmethod
    def _engine_known(cls, v: str) -> str:
        from elasticyolo.engines.names import check_engine_name

        return check_engine_name(v)

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> int:
        try:
            n = int(str(v).strip()) if not isinstance(v, bool) else None
        except ValueError:
            n = None
        if n is None or n < 0:
            raise ValueError(f"{v!r} is not a valid value: expected a whole number >= 0 "
                             "(0 = load data in the training process; default 8, capped at the CPUs per slot)")
        return n

    @field_validator("cache", mode="before")
    @classmethod
    def _cache(cls, v: Any) -> str:
        # Ultralytics' values: True/"ram", "disk", False.
        text = str(v).strip().lower() if v is not None else "false"
        value = {"true": "ram", "ram": "ram", "disk": "disk", "false": "false", "none": "false", "": "false"}.get(text)
        if value is None:
            raise ValueError(f"{v!r} is not a valid value: expected ram, disk or false (true means ram)")
        return value

    @field_validator("resume", mode="before")
    @classmethod
    def _resume(cls, v: Any) -> str | None:
        text = "" if v is None else str(v).strip()
        return None if text.lower() in ("", "false", "none", "0", "no") else ("true" if text.lower() in (
            "true", "1", "yes") else text)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and (not v.strip() or "/" in v or v in (".", "..")):
            raise ValueError(f"{v!r} is not a folder name (use project= for the parent folder)")
        return v

    @field_validator("hyp")
    @classmethod
    def _hyp_keys(cls, v: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(v) - set(ULTRALYTICS_PASSTHROUGH))
        if unknown:
            raise ValueError(f"unknown Ultralytics keys {unknown}")
        return v

    @field_validator("cooldown_s", mode="before")
    @classmethod
    def _cooldown(cls, v: Any) -> Any:
        if isinstance(v, str):
            parts = v.replace(":", ",").split(",")
            if len(parts) != 2:
                raise ValueError("expected MIN,MAX seconds")
            return tuple(int(p) for p in parts)
        return v

    @model_validator(mode="after")
    def _ranges(self) -> "TrainSpec":
        if self.max_nodes is not None and self.max_nodes < self.min_nodes:
            raise ValueError(f"max_nodes={self.max_nodes} is below min_nodes={self.min_nodes}")
        if self.cooldown_s[0] > self.cooldown_s[1]:
            raise ValueError("cooldown_s: MIN is above MAX")
        if self.pretrained == "true" and not self.model.endswith(".pt"):
            raise ValueError(f"pretrained=true: model={self.model} is an architecture without weights, and "
                             "elasticyolo downloads none; give pretrained=PATH.pt or s3://bucket/key.pt")
        return self

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pairs(cls, pairs: Iterable[str], where: str = "command line", **defaults: Any) -> "TrainSpec":
        """Parse `key=value` words (Ultralytics style). Unknown keys and bad values raise
        UserError naming the key."""
        values: dict[str, Any] = dict(defaults)
        hyp: dict[str, float] = dict(values.pop("hyp", {}) or {})
        words = list(pairs)
        for word in words:
            if "=" not in word:
                raise UserError(f"{where}: expected key=value, got {word!r}")
        cfg_words = [w.partition("=")[2] for w in words if w.partition("=")[0].strip() == "cfg"]
        if cfg_words:  # Ultralytics' cfg=FILE.yaml: its options first, the command line's override them
            words = cfg_pairs(cfg_words[-1]) + [w for w in words if w.partition("=")[0].strip() != "cfg"]
        for word in words:
            key, _, raw = word.partition("=")
            key = key.strip()
            if key in UNSUPPORTED_ULTRALYTICS:
                raise UserError(f"{where}: {key}= is not supported: {UNSUPPORTED_ULTRALYTICS[key]}")
            if key in ULTRALYTICS_PASSTHROUGH:
                try:
                    hyp[key] = float(raw)
                except ValueError:
                    raise UserError(f"{where}: {key}={raw!r} is not a number") from None
                continue
            if key not in cls.model_fields:
                raise UserError(f"{where}: unknown option {key!r} (see `elasticyolo train --help`)")
            values[key] = None if raw.lower() in ("none", "null") else raw
        if hyp:
            values["hyp"] = hyp
        return cls.validated(values, where)

    @classmethod
    def validated(cls, values: dict[str, Any], where: str) -> "TrainSpec":
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            raise UserError(f"{where}: {_one_line(exc)}") from None

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> "TrainSpec":
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise UserError(f"{where}: job spec is not JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise UserError(f"{where}: job spec must be a JSON object")
        return cls.validated(raw, where)

    def to_json(self) -> str:
        return self.model_dump_json()

    def ultralytics_overrides(self) -> dict[str, Any]:
        """The keys Ultralytics' `get_cfg` understands, for the loss gains and augmentation."""
        keys = ("imgsz", "batch", "lr0", "lrf", "momentum", "weight_decay", "warmup_epochs",
                "warmup_momentum", "warmup_bias_lr", "nbs", "cos_lr", "close_mosaic", "epochs",
                "seed", "workers", "optimizer", "amp", "channels_last", "freeze")
        out: dict[str, Any] = {k: getattr(self, k) for k in keys}
        out["cache"] = False if self.cache == "false" else self.cache
        out.update(self.hyp)
        out["model"] = self.model
        out["data"] = self.data
        return out


# Ultralytics options elasticyolo does not take, and what to use instead (one line each).
UNSUPPORTED_ULTRALYTICS = {
    "save_dir": "use project= and name=",
    "time": "use epochs=",
    "fraction": "write a smaller data.yaml (elasticyolo data synth, or a list file)",
    "rect": "training batches are shuffled shards of the elastic sampler (validation is rect)",
    "multi_scale": "train at one imgsz=",
    "single_cls": "relabel the dataset",
    "batch_size": "use batch= (images per worker per step)",
}


def cfg_pairs(path: str) -> list[str]:
    """The `key=value` words of an Ultralytics-style cfg YAML. Keys elasticyolo does not know are
    skipped when their value is Ultralytics' default (a copy of default.yaml works), else refused."""
    from pathlib import Path

    from elasticyolo.yamlfile import read_yaml_mapping

    data = read_yaml_mapping(Path(path).expanduser(), f"cfg={path}", "a mapping of option: value")
    defaults = ultralytics_defaults()
    words = []
    for key, value in data.items():
        key = str(key)
        known = key in TrainSpec.model_fields or key in ULTRALYTICS_PASSTHROUGH
        if not known and key in defaults and defaults[key] == value:
            continue
        if not known and key not in UNSUPPORTED_ULTRALYTICS:
            raise UserError(f"cfg={path}: unknown option {key!r} (see `elasticyolo train --help`)")
        if value is None:  # Ultralytics' "not set": our default applies
            continue
        if key == "pretrained" and value is True:  # Ultralytics' default, which unset means here
            continue
        words.append(f"{key}={value}")
    return words


_LAYER_NAME = re.compile(r"^\d+(\.[A-Za-z_][A-Za-z0-9_]*|\.\d+)*$")
FREEZE_HELP = "N (layers 0..N-1) or layer indices such as 0,1,2 or [0,1,2]"


def parse_freeze(v: Any) -> int | list[int | str] | None:
    """Ultralytics' `freeze`: None, a count N, or a list of layer indices (a dotted name such as
    `22.cv2` names part of a layer). On the command line a list is `0,1,2` or `[0,1,2]`."""
    if v is None:
        return None
    if isinstance(v, bool):
        raise ValueError(f"{v!r} is not a layer count: expected {FREEZE_HELP}")
    if isinstance(v, int):
        if v < 0:
            raise ValueError(f"{v} is negative: expected {FREEZE_HELP}")
        return v
    if isinstance(v, str):
        text = v.strip()
        if text.lower() in ("", "none", "null"):
            return None
        listed = text.startswith(("[", "(")) or "," in text
        items: list[Any] = [p.strip().strip("'\"") for p in text.strip("[]() ").split(",") if p.strip()]
        if not listed:
            if not text.isdigit():
                raise ValueError(f"{v!r} is not a layer count: expected {FREEZE_HELP}")
            return int(text)
    elif isinstance(v, (list, tuple)):
        items = list(v)
    else:
        raise ValueError(f"{v!r}: expected {FREEZE_HELP}")
    out: list[int | str] = []
    for item in items:
        if isinstance(item, bool) or not (isinstance(item, int) or _LAYER_NAME.match(str(item))):
            raise ValueError(f"{item!r} in {v!r} is not a layer index: expected {FREEZE_HELP}")
        value: int | str = int(item) if str(item).isdigit() else str(item)
        if isinstance(value, int) and value < 0:
            raise ValueError(f"{item!r} in {v!r} is negative: expected {FREEZE_HELP}")
        if value not in out:
            out.append(value)
    return out


def ultralytics_defaults() -> dict[str, Any]:
    """Ultralytics' default.yaml, read as a file (importing Ultralytics would import torch)."""
    import importlib.util
    from pathlib import Path

    import yaml

    spec = importlib.util.find_spec("ultralytics")
    if spec is None or not spec.origin:
        return {}
    try:
        return yaml.safe_load((Path(spec.origin).parent / "cfg" / "default.yaml").read_text()) or {}
    except (OSError, ValueError):
        return {}


def _one_line(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "spec"
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)
