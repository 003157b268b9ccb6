"""`elasticyolo train` and `data synth` as a user runs them: real processes, real model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
ELASTICYOLO = str(Path(sys.executable).with_name("elasticyolo"))


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ELASTICYOLO, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("synth")
    r = run("data", "synth", "--out", str(out), "--train", "24", "--val", "8", "--imgsz", "64", "--classes", "2")
    assert r.returncode == 0, r.stderr
    return out / "data.yaml"


def test_synth_writes_ultralytics_layout(data: Path) -> None:
    cfg = yaml.safe_load(data.read_text())
    assert cfg["names"] == {0: "red-square", 1: "green-circle"}
    root = data.parent
    images = sorted((root / "images" / "train").glob("*.png"))
    labels = sorted((root / "labels" / "train").glob("*.txt"))
    assert len(images) == len(labels) == 24
    for line in labels[0].read_text().splitlines():
        cls, *box = line.split()
        assert int(cls) in (0, 1) and all(0.0 <= float(v) <= 1.0 for v in box)


def test_train_offline_no_network_and_summary(data: Path, tmp_path: Path) -> None:
    """A full training run opens no socket to anything but loopback (audit hook on every
    connect/getaddrinfo), and ends with the summary line."""
    netlog = tmp_path / "net.log"
    netlog.write_text("")
    r = subprocess.run(
        [sys.executable, str(REPO / "tests" / "netguard.py"), str(netlog), "elasticyolo.cli:main", "train",
         "model=yolov8n.yaml", f"data={data}", "epochs=2", "imgsz=64", "batch=8", "close_mosaic=1"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "ELASTICYOLO_HOME": str(tmp_path / "home")},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert netlog.read_text() == "", f"network attempts: {netlog.read_text()}"
    assert "done: epochs=2" in r.stdout and "mAP50-95=" in r.stdout
    # The fonts were seeded locally, not downloaded.
    assert (tmp_path / "home" / "yolo" / "Ultralytics" / "Arial.ttf").exists()


def test_bad_data_yaml_one_line_error(tmp_path: Path) -> None:
    bad = tmp_path / "data.yaml"
    bad.write_text("train: [unclosed\n")
    r = run("train", f"data={bad}", "epochs=1")
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert str(bad) in r.stderr and "not valid YAML" in r.stderr
    missing = tmp_path / "nope.yaml"
    r = run("train", f"data={missing}")
    assert r.returncode != 0 and f"{missing}: data.yaml not found" in r.stderr
    no_val = tmp_path / "noval.yaml"
    no_val.write_text("train: images\nnames: [a]\n")
    r = run("data", "check", str(no_val))
    assert r.returncode != 0 and "missing 'val'" in r.stderr and r.stderr.count("\n") == 1


def test_unknown_or_download_model_fails_fast_naming_yaml(data: Path) -> None:
    r = run("train", "model=yolov8n.pt", f"data={data}")
    assert r.returncode != 0
    assert "yolov8n.yaml" in r.stderr and "download" in r.stderr
    assert r.stderr.count("\n") == 1
    r = run("train", "model=resnet50", f"data={data}")
    assert r.returncode != 0 and "neither a .yaml" in r.stderr


def test_bad_options_one_line(data: Path) -> None:
    for args, needle in [
        (["epochs=zero"], "epochs"),
        (["bogus=1"], "unknown option 'bogus'"),
        (["policy=fastest"], "policy"),
        (["min_nodes=3", "max_nodes=2"], "max_nodes=2 is below min_nodes=3"),
    ]:
        r = run("train", f"data={data}", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert needle in r.stderr and r.stderr.count("\n") == 1, r.stderr
