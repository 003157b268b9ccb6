"""Where a run folder goes on this machine: Ultralytics 8.4's `get_save_dir` (ultralytics/cfg) and
`increment_path` (ultralytics/utils/files.py), without importing Ultralytics (it imports torch; the
CLI never does). `tests/test_run_folder.py` checks these against Ultralytics' own functions.

    project unset     runs/detect/<name>
    project=REL       runs/detect/REL/<name>
    project=/ABS      /ABS/<name>
    name unset        train

An existing folder gets the next free `<name>-2`, `<name>-3`, ... unless `exist_ok`. `runs` is
relative to the current directory, Ultralytics' `runs_dir` outside a git checkout (elasticyolo keeps
its own Ultralytics settings, `train/offline.py`, so a `yolo settings runs_dir=` does not apply).
"""

from __future__ import annotations

import os
from pathlib import Path

RUNS_DIR = Path("runs")
TASK = "detect"  # the only task elasticyolo trains
DEFAULT_NAME = "train"  # Ultralytics' default: the mode
SEP = "-"  # Ultralytics 8.4's `increment_path` separator


def project_dir(project: str | Path | None) -> Path:
    """The parent of the run folders of `project`."""
    if project and Path(project).is_absolute():
        return Path(project)
    return RUNS_DIR / TASK / (project or "")


def increment_path(path: str | Path, exist_ok: bool = False) -> Path:
    """`path`, or the first free `path-2`, `path-3`, ... when it exists (Ultralytics' `increment_path`
    for a folder)."""
    path = Path(path)
    if exist_ok or not path.exists():
        return path
    for n in range(2, 9999):
        candidate = f"{path}{SEP}{n}"
        if not os.path.exists(candidate):
            break
    return Path(candidate)


def save_dir(project: str | Path | None, name: str | None, exist_ok: bool = False) -> Path:
    """The run folder a new run writes: Ultralytics' `get_save_dir` for the detect task."""
    return increment_path(project_dir(project) / (name or DEFAULT_NAME), exist_ok)


def latest_last_pt(project: str | Path | None) -> Path | None:
    """The newest `*/weights/last.pt` of `project`'s runs (what `resume=true` continues)."""
    found = list(project_dir(project).glob("*/weights/last.pt"))
    return max(found, key=lambda p: p.stat().st_mtime) if found else None
