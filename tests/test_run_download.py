"""`elasticyolo checkpoints download --run`: a cluster job's run folder, as rank 0 publishes it
(`RunPublisher`), copied from its store (moto S3 on 127.0.0.1, and file://) into Ultralytics' layout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Iterator

import boto3
import pytest

from elasticyolo.checkpoint.stores import open_store
from elasticyolo.local_cluster.servers import S3Server
from elasticyolo.train.run_publish import RunPublisher

BUCKET = "run-download"


def cli(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elasticyolo.cli", "checkpoints", "download", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def write_run_folder(root: Path, name: str | None) -> dict[str, bytes]:
    """The files a run folder has at a job's end (weights as opaque bytes: only copied here)."""
    files = {
        "args.yaml": f"job: j\nname: {name or 'null'}\nepochs: 2\n".encode(),
        "results.csv": b"epoch,time\n1,1.5\n2,3.0\n",
        "weights/last.pt": os.urandom(300_000),
        "weights/best.pt": os.urandom(200_000),
        "weights/epoch2.pt": os.urandom(100_000),
        "results.png": b"\x89PNG results",
        "timeline.png": b"\x89PNG timeline",
        "timeline/rank0-1.jsonl": b'{"t": 1}\n',
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return files


def publish(store_uri: str, job: str, src: Path, **options: str) -> None:
    """What rank 0 does: at an epoch end (`on_epoch`), then at the job's end (`finish`)."""
    publisher = RunPublisher(open_store(store_uri, **options), job)
    folder = SimpleNamespace(dir=src, args_yaml=src / "args.yaml", csv=src / "results.csv",
                             last_pt=src / "weights/last.pt", best_pt=src / "weights/best.pt",
                             epoch_pt=src / "weights/epoch2.pt")
    publisher.on_epoch(folder, improved=True)  # type: ignore[arg-type]
    publisher.upload(src / "timeline/rank0-1.jsonl", "timeline/rank0-1.jsonl")
    publisher.finish(folder, [src / "timeline.png"])  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def s3_env(s3_server: S3Server) -> Iterator[dict[str, str]]:
    boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
    env = {**os.environ, **s3_server.env()}
    env.pop("ELASTICYOLO_CHECKPOINT_STORE", None)
    saved = dict(os.environ)
    os.environ.update(s3_server.env())  # for the publisher in this process
    yield env
    os.environ.clear()
    os.environ.update(saved)


def same_tree(folder: Path, files: dict[str, bytes]) -> None:
    got = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert sorted(got) == sorted(files) and all(got[k] == files[k] for k in files)


def test_s3_run_folder_downloads_into_ultralytics_layout(s3_env: dict[str, str], tmp_path: Path) -> None:
    files = write_run_folder(tmp_path / "node", name=None)
    store = f"s3://{BUCKET}/jobs"
    publish(store, "shapes", tmp_path / "node")
    here = tmp_path / "here"
    here.mkdir()

    r = cli("--run", "--job", "shapes", "--store", store, cwd=here, env=s3_env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("runs/detect/shapes  run folder of job shapes  8 files"), r.stdout
    same_tree(here / "runs" / "detect" / "shapes", files)
    # Again: the next free folder, as Ultralytics names a new run; nothing left behind but the two.
    r = cli("--run", "--job", "shapes", "--store", store, cwd=here, env=s3_env)
    assert r.returncode == 0 and r.stdout.startswith("runs/detect/shapes-2 "), r.stderr + r.stdout
    same_tree(here / "runs" / "detect" / "shapes-2", files)
    assert sorted(p.name for p in (here / "runs" / "detect").iterdir()) == ["shapes", "shapes-2"]

    # A job without a run folder: one line, nothing written.
    r = cli("--run", "--job", "nojob", "--store", store, "-o", str(tmp_path / "out"), cwd=here, env=s3_env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert f"job 'nojob' has no run folder in {store}" in r.stderr and not (tmp_path / "out").exists()
    r = cli("--run", "--best", "--job", "shapes", "--store", store, cwd=here, env=s3_env)
    assert r.returncode == 2 and "not allowed with argument" in r.stderr and r.stderr.count("\n") == 1

    # The CLI side never imports torch.
    code = ("import sys; from elasticyolo.cli import main; rc = main(['checkpoints', 'download', '--run', '--job', "
            f"'shapes', '--store', {store!r}, '-o', {str(tmp_path / 'notorch')!r}]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], cwd=here, env=s3_env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    same_tree(tmp_path / "notorch", files)


def test_file_store_run_folder_downloads_to_its_name_or_a_given_folder(tmp_path: Path) -> None:
    files = write_run_folder(tmp_path / "node", name="exp")
    store = f"file://{tmp_path / 'store'}"
    publish(store, "shapes", tmp_path / "node")
    env = {k: v for k, v in os.environ.items() if k != "ELASTICYOLO_CHECKPOINT_STORE"}
    here = tmp_path / "here"
    here.mkdir()

    r = cli("--run", "--job", "shapes", "--store", store, cwd=here, env=env)
    assert r.returncode == 0 and r.stdout.startswith("runs/detect/exp "), r.stderr + r.stdout  # the job's name=
    same_tree(here / "runs" / "detect" / "exp", files)

    # -o: that folder; an existing one gets the store's files, its own others stay.
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    (out / "results.csv").write_text("old")
    r = cli("--run", "--job", "shapes", "--store", store, "-o", str(out), cwd=here, env=env)
    assert r.returncode == 0, r.stderr
    same_tree(out, {**files, "notes.txt": b"mine"})
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no partial folder left

    r = cli("--run", "--job", "nojob", "--store", store, cwd=here, env=env)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "job 'nojob' has no run folder" in r.stderr
