"""`elasticyolo checkpoints list|show|download|prune` in subprocesses, against moto on 127.0.0.1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import boto3
import pytest

from elasticyolo.local_cluster.servers import S3Server

torch = pytest.importorskip("torch")
from test_checkpoint_format import make_state, snapshot  # noqa: E402  (sets the offline Ultralytics env)
from test_checkpoint_manager import fake_ckpt  # noqa: E402

from elasticyolo.checkpoint import CheckpointManager, open_store  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
BUCKET = "cli-bucket"
JOB = "cli-job"


def cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elasticyolo.cli", "checkpoints", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def env(s3_server: S3Server) -> Iterator[dict[str, Any]]:
    saved = dict(os.environ)
    os.environ.update(s3_server.env())  # for this process's manager too; restored below
    e = {**os.environ, **s3_server.env(), "ELASTICYOLO_LOG_FORMAT": "json"}
    e.pop("ELASTICYOLO_CHECKPOINT_STORE", None)
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url, region_name="us-east-1",
                          aws_access_key_id="testing", aws_secret_access_key="testing")
    client.create_bucket(Bucket=BUCKET)
    store = open_store(f"s3://{BUCKET}/runs", endpoint_url=s3_server.endpoint_url)
    state = make_state()
    with CheckpointManager(store, JOB, save_period_steps=10, save_period_s=0, keep_last=10) as mgr:
        for step in (10, 20):
            assert mgr.maybe_save(step, 0, lambda: fake_ckpt(step)) and mgr.wait(30)
        assert mgr.maybe_save(30, 1, lambda: snapshot(state, global_step=30, epoch=1, epoch_end=True),
                              epoch_end=True)
        assert mgr.wait(60)
    yield {"env": e, "store": f"s3://{BUCKET}/runs", "client": client}
    os.environ.clear()
    os.environ.update(saved)


def test_list_and_show(env: dict[str, Any]) -> None:
    r = cli("list", "--job", JOB, "--store", env["store"], env=env["env"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["STEP", "EPOCH", "E.STEP"] and len(lines) == 4
    assert lines[-1].startswith("*") and lines[-1].split()[1:3] == ["30", "1e"]
    r = cli("list", "--json", "--job", JOB, "--store", env["store"], env=env["env"])
    rows = json.loads(r.stdout)
    assert [m["step"] for m in rows] == [10, 20, 30] and [m["latest"] for m in rows] == [False, False, True]
    assert rows[-1]["world_size"] == 2 and len(rows[-1]["sha256"]) == 64 and rows[-1]["ultralytics_version"]
    r = cli("show", "20", "--job", JOB, "--store", env["store"], env=env["env"])
    assert r.returncode == 0 and json.loads(r.stdout)["step"] == 20
    r = cli("show", "--job", JOB, "--store", env["store"], env=env["env"])
    assert json.loads(r.stdout)["step"] == 30
    r = cli("show", "99", "--job", JOB, "--store", env["store"], env=env["env"])
    assert r.returncode == 2 and "no checkpoint '99'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_download_then_yolo_predict(env: dict[str, Any], tmp_path: Path) -> None:
    import numpy as np
    from ultralytics import YOLO

    r = cli("download", "--job", JOB, "--store", env["store"], "-o", str(tmp_path), env=env["env"])
    assert r.returncode == 0, r.stderr
    path = tmp_path / f"{JOB}-step30.pt"
    assert path.exists() and "verified" in r.stdout
    results = YOLO(str(path)).predict(np.full((80, 112, 3), 127, dtype=np.uint8), imgsz=64, verbose=False)
    assert len(results) == 1


def test_download_corrupt_is_refused(env: dict[str, Any], tmp_path: Path) -> None:
    rows = json.loads(cli("list", "--json", "--job", JOB, "--store", env["store"], env=env["env"]).stdout)
    key = "runs/" + rows[0]["key"]
    client = env["client"]
    body = bytearray(client.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    body[-10] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key=key, Body=bytes(body))
    r = cli("download", "10", "--job", JOB, "--store", env["store"], "-o", str(tmp_path / "x.pt"), env=env["env"])
    assert r.returncode == 2 and "corrupt" in r.stderr and "sha256" in r.stderr
    assert not (tmp_path / "x.pt").exists() and not list(tmp_path.iterdir())


def test_prune(env: dict[str, Any]) -> None:
    r = cli("prune", "--keep-last", "1", "--dry-run", "--job", JOB, "--store", env["store"], env=env["env"])
    assert r.returncode == 0 and "would delete 2 checkpoints" in r.stdout
    r = cli("prune", "--keep-last", "1", "--job", JOB, "--store", env["store"], env=env["env"])
    assert r.returncode == 0 and "deleted 2 checkpoints, 2 objects" in r.stdout
    rows = json.loads(cli("list", "--json", "--job", JOB, "--store", env["store"], env=env["env"]).stdout)
    assert [m["step"] for m in rows] == [30]


def test_errors_are_one_line_and_no_torch(env: dict[str, Any]) -> None:
    for args, words in (
        (("--store", "gs://x/y"), "unsupported scheme"),
        (("--store", "s3://missing-bucket"), "does not exist"),
        ((), "no checkpoint store"),
    ):
        r = cli("list", "--job", JOB, *args, env=env["env"])
        assert r.returncode == 2 and words in r.stderr, r.stderr
        assert r.stderr.startswith("elasticyolo checkpoints: error:") and len(r.stderr.strip().splitlines()) == 1
    code = ("import sys; from elasticyolo.cli import main; rc = main(['checkpoints', 'list', '--job', %r, "
            "'--store', %r]); assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)" % (JOB, env["store"]))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env["env"]}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
