"""A cluster job's run folder, from its store to a folder on this machine. No torch.

Rank 0 publishes Ultralytics' run folder under `<job>/run/` in the job's store (`layout.run_key`,
`train/run_publish.py`); every object there is copied with its relative path, so the copy is laid
out as the folder Ultralytics writes. The local folder is Ultralytics' for the job's `name` (its
args.yaml), else the job name: `runs/detect/<name>`, or the next free `<name>-2`, ... when that
exists (`run_layout.py`); or a folder the caller names.

Files land in a hidden folder beside the destination and are moved into place once every one
arrived: a failed download leaves no new folder, and an existing one keeps its files.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import yaml

from elasticyolo.checkpoint.layout import run_key
from elasticyolo.checkpoint.stores import NotFound, ObjectInfo, Store
from elasticyolo.errors import UserError
from elasticyolo.run_layout import save_dir


@dataclass(frozen=True)
class RunDownload:
    dest: Path
    files: list[str]  # relative paths, as in the store
    size: int


def run_objects(store: Store, job: str) -> list[tuple[str, ObjectInfo]]:
    """(relative path, object) of each file of `job`'s published run folder, in key order."""
    prefix = run_key(job, "")
    out = []
    for info in store.list(prefix):
        rel = info.key[len(prefix):]
        if not rel or rel.endswith("/"):  # the prefix itself, or a folder marker
            continue
        parts = PurePosixPath(rel).parts
        if rel.startswith("/") or any(p in ("", ".", "..") for p in parts):
            raise UserError(f"{store.uri}: {info.key!r} is not a path inside the run folder; not downloading it")
        out.append((rel, info))
    return out


def run_name(store: Store, job: str) -> str:
    """The job's `name=` (its published args.yaml), else the job name."""
    try:
        args = yaml.safe_load(store.get_bytes(run_key(job, "args.yaml")))
    except (NotFound, yaml.YAMLError):
        return job
    name = args.get("name") if isinstance(args, dict) else None
    if not isinstance(name, str) or not name.strip() or "/" in name or "\\" in name or name in (".", ".."):
        return job
    return name


def download_run(store: Store, job: str, dest: str | Path | None = None) -> RunDownload:
    """Copy `job`'s run folder to `dest` (a folder: created, or its files with the same names
    replaced), default `runs/detect/<name>` (the next free one)."""
    objects = run_objects(store, job)
    if not objects:
        raise UserError(f"job {job!r} has no run folder in {store.uri} (rank 0 publishes {run_key(job, '')} "
                        "at the end of the job's first epoch)")
    target = Path(dest) if dest is not None else save_dir(None, run_name(store, job))
    if target.exists() and not target.is_dir():
        raise UserError(f"{target}: exists and is not a folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    full = target.resolve()
    part = full.parent / f".{full.name}.part-{os.getpid()}"  # same filesystem: moves are renames
    size = 0
    try:
        part.mkdir()
        for rel, info in objects:
            path = part / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb+") as f:
                store.download(info.key, f)
                size += f.tell()
        _move_into_place(part, target)
    finally:
        shutil.rmtree(part, ignore_errors=True)
    return RunDownload(target, [rel for rel, _ in objects], size)


def _move_into_place(part: Path, target: Path) -> None:
    if not target.exists():
        os.replace(part, target)
        return
    for src in sorted(p for p in part.rglob("*") if p.is_file()):
        dst = target / src.relative_to(part)
        dst.parent.mkdir(parents=True, exist_ok=True)
        os.replace(src, dst)
