"""`elasticyolo train` writes Ultralytics' run folder; Ultralytics' options with their meanings."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elasticyolo.errors import UserError
from elasticyolo.spec import TrainSpec
from elasticyolo.train.fitness import best_epoch, should_stop
from elasticyolo.run_layout import save_dir

ELASTICYOLO = str(Path(sys.executable).with_name("elasticyolo"))
# Ultralytics 8.4's results.csv header for a YOLOv8 detector (DetectionTrainer.save_metrics).
ULTRALYTICS_COLUMNS = [
    "epoch", "time", "train/box_loss", "train/cls_loss", "train/dfl_loss", "metrics/precision(B)",
    "metrics/recall(B)", "metrics/mAP50(B)", "metrics/mAP50-95(B)", "val/box_loss", "val/cls_loss",
    "val/dfl_loss", "lr/pg0", "lr/pg1", "lr/pg2",
]


def run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nice", "-n", "5", ELASTICYOLO, *args], capture_output=True, text=True, timeout=600,
                          cwd=cwd)


def test_fitness_and_early_stopping_as_ultralytics() -> None:
    h = [{"epoch": 0, "mAP50-95": 0.1}, {"epoch": 1, "mAP50-95": 0.3}, {"epoch": 2, "mAP50-95": 0.2},
         {"epoch": 3, "mAP50-95": 0.25}]
    assert best_epoch(h) == (1, 0.3)
    assert best_epoch(h + [{"epoch": 4, "mAP50-95": 0.3}]) == (4, 0.3)  # a tie moves the best later
    assert not should_stop(h, patience=3) and should_stop(h, patience=2)
    assert not should_stop(h, patience=0)  # 0: never
    assert best_epoch([{"epoch": 0}]) is None and not should_stop([{"epoch": 0}], 1)


def test_cfg_yaml_resume_and_unsupported_options(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("epochs: 7\nbatch: 4\ntask: detect\nmode: train\nplots: true\nmosaic: 0.5\nproject: null\n")
    spec = TrainSpec.from_pairs(["data=d.yaml", f"cfg={cfg}", "batch=2"])
    assert (spec.epochs, spec.batch, spec.hyp["mosaic"], spec.project) == (7, 2, 0.5, None)  # command line wins
    cfg.write_text("plots: false\n")  # an Ultralytics option we do not take, not at its default
    with pytest.raises(UserError, match="unknown option 'plots'"):
        TrainSpec.from_pairs(["data=d.yaml", f"cfg={cfg}"])
    with pytest.raises(UserError, match="cfg=/nope.yaml: file not found"):
        TrainSpec.from_pairs(["data=d.yaml", "cfg=/nope.yaml"])
    with pytest.raises(UserError, match="time= is not supported: use epochs="):
        TrainSpec.from_pairs(["data=d.yaml", "time=2"])
    assert TrainSpec.from_pairs(["data=d", "resume=True"]).resume == "true"
    assert TrainSpec.from_pairs(["data=d", "resume=False"]).resume is None


def test_train_writes_ultralytics_run_folder_best_pt_validates_and_resume(tmp_path: Path) -> None:
    r = run("data", "synth", "--out", "d", "--train", "16", "--val", "8", "--imgsz", "64", "--classes", "2",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    r = run("train", "model=yolov8n.yaml", "data=d/data.yaml", "epochs=2", "imgsz=64", "batch=8", "workers=0",
            "save_period=1", "name=exp", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    run_dir = tmp_path / "runs" / "detect" / "exp"
    assert "results saved to runs/detect/exp" in r.stdout
    for name in ("args.yaml", "results.csv", "results.png", "weights/last.pt", "weights/best.pt",
                 "weights/epoch1.pt", "weights/epoch2.pt"):
        assert (run_dir / name).is_file(), name
    with open(run_dir / "results.csv", newline="") as fh:
        rows = list(csv.reader(fh))
    assert rows[0] == ULTRALYTICS_COLUMNS and [row[0] for row in rows[1:]] == ["1", "2"]
    assert all(float(v) >= 0 for row in rows[1:] for v in row)
    args = yaml.safe_load((run_dir / "args.yaml").read_text())
    assert args["epochs"] == 2 and args["data"] == "d/data.yaml" and args["save_period"] == 1

    from PIL import Image

    with Image.open(run_dir / "results.png") as im:
        im.load()  # decodes
        # Ultralytics' plot_results: a (columns + 2) x 6 inch figure at 200 dpi; 10 plotted columns.
        assert im.size == (2400, 1200)

    import elasticyolo.train  # noqa: F401 - offline Ultralytics settings first
    from ultralytics import YOLO

    metrics = YOLO(str(run_dir / "weights" / "best.pt")).val(data=str(tmp_path / "d" / "data.yaml"), imgsz=64,
                                                              batch=8, plots=False, verbose=False, workers=0,
                                                              project=str(tmp_path / "val"))
    assert 0.0 <= metrics.box.map <= 1.0

    # resume=true: the newest run's last.pt, its own options from args.yaml; one more epoch.
    r = run("train", "resume=true", "epochs=3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("resumed runs/detect/exp from runs/detect/exp/weights/last.pt: epoch=2" in r.stderr
            and "done: epochs=3" in r.stdout)
    with open(run_dir / "results.csv", newline="") as fh:
        assert [row[0] for row in csv.reader(fh)][1:] == ["1", "2", "3"]
    r = run("train", "resume=true", cwd=tmp_path)
    assert r.returncode == 2 and "already finished (3 epochs)" in r.stderr and r.stderr.count("\n") == 1
    # A new run next to it gets the next free name, as Ultralytics' increment_path.
    assert save_dir(tmp_path / "runs" / "detect", "exp") == tmp_path / "runs" / "detect" / "exp-2"


@pytest.mark.parametrize("project", [None, "proj", "ABS"])
@pytest.mark.parametrize("name", [None, "exp"])
def test_save_dir_is_ultralytics_get_save_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, project: str | None,
                                              name: str | None) -> None:
    """`project`, `name`, `exist_ok` as Ultralytics' own `get_save_dir` (with its runs_dir at ./runs)."""
    from types import SimpleNamespace

    import elasticyolo.train  # noqa: F401 - offline Ultralytics settings first
    import ultralytics.cfg

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(ultralytics.cfg, "TESTS_RUNNING", False)
    monkeypatch.setattr(ultralytics.cfg, "SETTINGS", {"runs_dir": str(tmp_path / "runs")})
    if project == "ABS":
        project = str(tmp_path / "elsewhere")

    def ultralytics_dir(exist_ok: bool) -> Path:
        args = SimpleNamespace(project=project, name=name, task="detect", mode="train", exist_ok=exist_ok)
        return ultralytics.cfg.get_save_dir(args)

    seen = []
    for _ in range(3):  # a fresh folder, then the next free ones
        for exist_ok in (False, True):
            assert save_dir(project, name, exist_ok).resolve() == ultralytics_dir(exist_ok)
        seen.append(save_dir(project, name))
        seen[-1].mkdir(parents=True)
    base = {None: tmp_path / "runs" / "detect", "proj": tmp_path / "runs" / "detect" / "proj"}.get(
        project, tmp_path / "elsewhere")
    stem = name or "train"
    assert [p.resolve() for p in seen] == [base / stem, base / f"{stem}-2", base / f"{stem}-3"]


def test_resume_true_finds_the_run_where_it_was_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from elasticyolo.commands.train import resume_source

    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="no run with weights/last.pt under runs/detect/"):
        resume_source(["resume=true"])
    for folder in ("runs/detect/train/weights", "runs/detect/proj/exp/weights"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "last.pt").write_bytes(b"x")
    assert resume_source(["resume=true"]) == Path("runs/detect/train/weights/last.pt")
    assert resume_source(["resume=true", "project=proj"]) == Path("runs/detect/proj/exp/weights/last.pt")
    assert resume_source(["resume=true", "project=proj", "name=exp"]) == Path("runs/detect/proj/exp/weights/last.pt")
    with pytest.raises(UserError, match="runs/detect/nope/weights/last.pt not found"):
        resume_source(["resume=true", "name=nope"])


def test_a_second_train_writes_the_next_ultralytics_folder(tmp_path: Path) -> None:
    """Two `elasticyolo train` runs in one directory: runs/detect/train, then runs/detect/train-2
    (Ultralytics 8.4's names), each a whole run folder."""
    r = run("data", "synth", "--out", "d", "--train", "8", "--val", "4", "--imgsz", "64", "--classes", "2",
            cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    for folder in ("train", "train-2"):
        r = run("train", "model=yolov8n.yaml", "data=d/data.yaml", "epochs=1", "imgsz=64", "batch=8", "workers=0",
                "val=false", cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        assert f"results saved to runs/detect/{folder}\n" in r.stdout + "\n", r.stdout
        for name in ("args.yaml", "results.csv", "weights/last.pt", "weights/best.pt"):
            assert (tmp_path / "runs" / "detect" / folder / name).is_file(), (folder, name)
    assert sorted(p.name for p in (tmp_path / "runs" / "detect").iterdir()) == ["train", "train-2"]
