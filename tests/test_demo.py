"""`elasticyolo demo`: what it needs beyond the package fails in one line, the example price table
prices the nodes its metadata servers describe, the run folder comes down from the store whole.
The demo itself (about 2 minutes) runs under `-m slow`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import boto3
import pytest

from elasticyolo.cli import main
from elasticyolo.cost import load_price_table
from elasticyolo.demo import BUCKET, PRICE_TABLE, RUN_FILES, download_run_folder
from elasticyolo.local_cluster.metadata_server import MetadataServer
from elasticyolo.local_cluster.servers import MOTO_EXTRA, S3Server

REPO = Path(__file__).resolve().parents[1]


def test_without_moto_the_demo_fails_in_one_line_naming_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))  # no moto_server beside it
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "--workdir", str(tmp_path / "work")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "moto_server not found" in err and MOTO_EXTRA in err, err
    assert not (tmp_path / "work").exists() and not (tmp_path / "runs").exists()


def test_too_few_epochs_for_the_story_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--epochs", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--epochs 3" in err, err


def test_example_price_table_prices_what_the_metadata_states() -> None:
    table = load_price_table(PRICE_TABLE)
    for provider, itype in MetadataServer().state.instance_type.items():
        row = table.get(itype)
        assert row is not None, f"{PRICE_TABLE.name} has no row for {provider}'s {itype}"
        assert 0 < row["spot"] < row["on_demand"], (itype, row)


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield s3_server
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=BUCKET, Key=obj["Key"])
    client.delete_bucket(Bucket=BUCKET)


def test_run_folder_downloads_whole_into_a_new_folder(s3: S3Server, tmp_path: Path) -> None:
    client = boto3.client("s3")
    files = {rel: f"{rel} bytes".encode() for rel in (*RUN_FILES, "args.yaml", "timeline/rank0-1.jsonl")}
    for rel, data in files.items():
        client.put_object(Bucket=BUCKET, Key=f"jobs/demo/run/{rel}", Body=data)
    client.put_object(Bucket=BUCKET, Key="jobs/demo/ckpt/000000000008-1-a.pt", Body=b"checkpoint")
    first = download_run_folder(f"s3://{BUCKET}/jobs", "demo", tmp_path / "runs", "demo")
    second = download_run_folder(f"s3://{BUCKET}/jobs", "demo", tmp_path / "runs", "demo")
    assert (first, second) == (tmp_path / "runs" / "demo", tmp_path / "runs" / "demo-2")
    for folder in (first, second):
        got = {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
        assert got == files


@pytest.mark.slow
def test_demo_shows_checkpoint_drain_cost_and_keeps_its_run_folder(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "elasticyolo.cli", "demo", "--workdir", str(tmp_path / "work")],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    out = r.stdout
    assert f"CHECKPOINT s3://{BUCKET}/jobs/demo/ckpt/" in out
    # The demo runs the default engine (torch): a drained node's workers stop at a commit.
    assert "0 lost steps" in out and "lost steps 0, mode stop" in out
    assert "SAVED $" in out and "saved $" in out
    run = tmp_path / "runs" / "detect" / "demo"
    assert all((run / f).is_file() for f in RUN_FILES), sorted(p.name for p in run.rglob("*"))
    assert "run folder    runs/detect/demo/" in out
    assert not (tmp_path / "work").exists()  # the work dir goes, the run folder stays
