"""Validate an Ultralytics `data.yaml` on local disk with one-line errors naming file and problem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from elasticyolo.errors import UserError

IMAGE_SUFFIXES = {".bmp", ".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp"}


def _resolve(base: Path, entry: Any, key: str, where: str) -> list[str]:
    entries = entry if isinstance(entry, list) else [entry]
    out = []
    for e in entries:
        if not isinstance(e, str) or not e:
            raise UserError(f"{where}: '{key}' must be a path or a list of paths")
        p = Path(e)
        p = p if p.is_absolute() else base / p
        if not p.exists():
            raise UserError(f"{where}: '{key}' path {p} does not exist")
        if p.is_dir() and not any(f.suffix.lower() in IMAGE_SUFFIXES for f in p.rglob("*")):
            raise UserError(f"{where}: '{key}' directory {p} holds no images")
        out.append(str(p))
    return out


def load_data_yaml(path: str | Path) -> dict[str, Any]:
    """Return a data dict with absolute `train`/`val` paths, `nc`, `names` (index -> name) and
    `channels`, ready for Ultralytics' dataset builders. An `s3://.../data.yaml` resolves to its
    staged copy on this node (staging/stager.py)."""
    if str(path).startswith("s3://"):
        from elasticyolo.staging.stager import resolve_data_yaml

        path = resolve_data_yaml(str(path))
    p = Path(path)
    where = str(p)
    if not p.is_file():
        raise UserError(f"{where}: data.yaml not found")
    try:
        raw = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{where}: not valid YAML{at}") from None
    if not isinstance(raw, dict):
        raise UserError(f"{where}: expected a mapping with train, val and names")
    for key in ("train", "val"):
        if key not in raw:
            raise UserError(f"{where}: missing '{key}'")
    names = raw.get("names")
    if isinstance(names, list):
        names = dict(enumerate(names))
    if names is None and isinstance(raw.get("nc"), int):
        names = {i: f"class{i}" for i in range(raw["nc"])}
    if not isinstance(names, dict) or not names:
        raise UserError(f"{where}: 'names' must be a non-empty list or mapping (or give 'nc')")
    try:
        names = {int(k): str(v) for k, v in names.items()}
    except (TypeError, ValueError):
        raise UserError(f"{where}: 'names' keys must be class indices") from None
    if sorted(names) != list(range(len(names))):
        raise UserError(f"{where}: 'names' indices must be 0..{len(names) - 1}")
    if "nc" in raw and raw["nc"] != len(names):
        raise UserError(f"{where}: nc={raw['nc']} but {len(names)} names")
    base = Path(raw.get("path") or p.parent)
    base = base if base.is_absolute() else (p.parent / base)
    data = dict(raw)
    data.update(
        path=str(base.resolve()),
        train=_resolve(base, raw["train"], "train", where),
        val=_resolve(base, raw["val"], "val", where),
        names=names,
        nc=len(names),
        channels=int(raw.get("channels", 3)),
        yaml_file=str(p.resolve()),
    )
    for key in ("train", "val"):
        if len(data[key]) == 1:
            data[key] = data[key][0]
    return data
