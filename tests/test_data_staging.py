"""Datasets staged from the local S3 server (moto): verified copies, reuse, resume after a kill,
corruption in flight, the cache cap. A fault-injecting proxy sits between boto3 and moto."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import boto3
import botocore.config
import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.data.yaml_check import load_data_yaml
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.staging.cache import CacheFullError, DatasetCache, DatasetLock
from elasticyolo.staging.stager import StagingError, Stager, resolve_data_yaml
from elasticyolo.staging.upload import upload_dataset
from support.s3proxy import S3FaultProxy
from elasticyolo.local_cluster.servers import S3Server

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("shapes")
    write_dataset(out, SynthSpec(train=24, val=6, imgsz=64))
    return out


@pytest.fixture
def bucket(s3: S3Server, request: pytest.FixtureRequest) -> str:
    name = "stage-" + request.node.name.replace("_", "-")[:40].lower().strip("-")
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.fixture
def proxy(s3: S3Server) -> Iterator[S3FaultProxy]:
    with S3FaultProxy(s3.port) as p:
        yield p


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _same_tree(src: Path, copy: Path) -> None:
    want = _files(src)
    got = {k: v for k, v in _files(copy).items() if not k.endswith(".cache")}
    assert got == want


def test_stage_verifies_reuses_and_follows_changes(tmp_path: Path, dataset: Path, bucket: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"s3://{bucket}/shapes/data.yaml"
    upload_dataset(dataset, f"s3://{bucket}/shapes", {})
    cache = DatasetCache(tmp_path / "cache")
    first = Stager(cache, max_concurrency=4).stage(uri)
    assert not first.reused and first.downloaded_files == first.files == len(_files(dataset))
    assert first.verified == {"md5": first.files}
    files = first.path.parent / "files"
    _same_tree(dataset, files)
    # the rewritten data.yaml points at the local copy; workers resolve s3:// through it
    monkeypatch.setenv("ELASTICYOLO_DATA_CACHE", str(cache.root))
    data = load_data_yaml(uri)
    assert data["train"] == str(files / "images" / "train") and data["nc"] == 3
    from elasticyolo.staging.stager import release

    release(uri)  # a training process keeps its shared lock; this test changes the dataset next

    again = Stager(cache).stage(uri)
    assert again.reused and again.downloaded_files == 0

    s3c = boto3.client("s3")
    s3c.put_object(Bucket=bucket, Key="shapes/labels/train/train_00000.txt", Body=b"0 0.5 0.5 0.2 0.2\n")
    s3c.put_object(Bucket=bucket, Key="shapes/extra.txt", Body=b"new")
    s3c.delete_object(Bucket=bucket, Key="shapes/labels/val/val_00000.txt")
    changed = Stager(cache).stage(uri)
    assert not changed.reused and changed.downloaded_files == 2
    assert (files / "labels/train/train_00000.txt").read_bytes() == b"0 0.5 0.5 0.2 0.2\n"
    assert (files / "extra.txt").read_bytes() == b"new"
    assert not (files / "labels/val/val_00000.txt").exists()


_STAGE_SCRIPT = """
import sys
from elasticyolo.staging.cache import DatasetCache
from elasticyolo.staging.stager import Stager
Stager(DatasetCache(sys.argv[1]), max_concurrency=2, large_object_bytes=4 << 20, segment_bytes=1 << 20).stage(sys.argv[2])
"""


def test_interrupted_staging_resumes(tmp_path: Path, dataset: Path, bucket: str, proxy: S3FaultProxy,
                                     s3: S3Server) -> None:
    uri = f"s3://{bucket}/shapes/data.yaml"
    upload_dataset(dataset, f"s3://{bucket}/shapes", {})
    big = os.urandom(12 * MiB)
    boto3.client("s3").put_object(Bucket=bucket, Key="shapes/shards/big.bin", Body=big)
    cache = DatasetCache(tmp_path / "cache")
    entry = cache.entry(uri)
    proxy.get_delay_s = 0.15
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": proxy.endpoint_url}
    proc = subprocess.Popen([sys.executable, "-c", _STAGE_SCRIPT, str(cache.root), uri], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    segments = list(entry.partial.glob("*.segments")) if entry.partial.exists() else []
    try:
        def halfway() -> bool:
            nonlocal segments
            segments = list(entry.partial.glob("*.segments")) if entry.partial.exists() else []
            return (len(entry.journal()) >= 6 and bool(segments)
                    and len(segments[0].read_text().splitlines()) >= 3)
        wait_for(halfway, 60, "half of the dataset and two segments of the large object")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    journaled = set(entry.journal())
    segs_done = len(segments[0].read_text().splitlines()) - 1  # read after the kill: all it journaled
    assert 6 <= len(journaled) < len(_files(dataset)) and 2 <= segs_done < 12

    # the killed stager's last GETs are still being served: count only the resumed stager's
    wait_for(lambda: proxy.in_flight == 0, 30, "the killed stager's requests served")
    proxy.get_delay_s, proxy.gets = 0.0, type(proxy.gets)()
    from elasticyolo.staging.stager import s3_client

    stager = Stager(cache, max_concurrency=2, large_object_bytes=4 * MiB, segment_bytes=MiB,
                    client=s3_client({"endpoint_url": proxy.endpoint_url}, 2))
    result = stager.stage(uri)
    fetched = {k.removeprefix("shapes/") for k in proxy.gets}
    assert not fetched & journaled, "a journaled object was fetched again"
    assert result.downloaded_files == result.files - len(journaled)
    assert proxy.gets["shapes/shards/big.bin"] == 12 - segs_done  # only the missing segments
    files = result.path.parent / "files"
    assert (files / "shards/big.bin").read_bytes() == big
    (files / "shards/big.bin").unlink()
    _same_tree(dataset, files)


def test_corrupt_object_is_detected(tmp_path: Path, dataset: Path, bucket: str, proxy: S3FaultProxy) -> None:
    uri = f"s3://{bucket}/shapes/data.yaml"
    upload_dataset(dataset, f"s3://{bucket}/shapes", {})
    # One object without an upload checksum: only our MD5-vs-ETag check can catch its corruption.
    plain = boto3.client("s3", config=botocore.config.Config(request_checksum_calculation="when_required"))
    key = "shapes/images/train/train_00003.png"
    plain.upload_fileobj(io.BytesIO((dataset / "images/train/train_00003.png").read_bytes()), bucket, key)
    from elasticyolo.staging.stager import s3_client

    client = s3_client({"endpoint_url": proxy.endpoint_url}, 4)
    cache = DatasetCache(tmp_path / "cache")

    proxy.corrupt[key] = 1  # corrupted once in flight: detected, fetched again, staged correctly
    result = Stager(cache, client=client).stage(uri)
    assert proxy.gets[key] == 2
    _same_tree(dataset, result.path.parent / "files")

    cache2 = DatasetCache(tmp_path / "cache2")
    proxy.corrupt[key] = -1  # always corrupt: staging fails, naming the object; nothing bad is kept
    with pytest.raises(StagingError, match=r"train_00003.png: MD5 \w+ != ETag \w+: corrupt copy \(after 3 downloads\)"):
        Stager(cache2, client=client).stage(uri)
    entry = cache2.entry(uri)
    assert entry.read_meta()["state"] == "failed"
    assert not entry.local_path("images/train/train_00003.png").exists()
    assert not entry.data_yaml.exists()


def test_cache_cap_evicts_least_recently_used_but_never_in_use(tmp_path: Path, dataset: Path, bucket: str) -> None:
    size = sum(len(b) for b in _files(dataset).values())
    for name in ("a", "b", "c"):
        upload_dataset(dataset, f"s3://{bucket}/{name}", {})
    cache = DatasetCache(tmp_path / "cache", max_bytes=int(2.5 * size))  # room for two
    stager = Stager(cache)
    a, b = (stager.stage(f"s3://{bucket}/{n}/data.yaml") for n in ("a", "b"))
    Stager(cache).stage(a.uri)  # a is now the most recently used
    c = stager.stage(f"s3://{bucket}/c/data.yaml")
    assert c.evicted == [cache.entry(b.uri).name] and not cache.entry(b.uri).dir.exists()
    assert cache.entry(a.uri).data_yaml.exists()

    in_use = [DatasetLock(cache.entry(u)) for u in (a.uri, c.uri)]
    for lock in in_use:
        assert lock.acquire(exclusive=False, timeout=1)  # as a worker training on it does
    with pytest.raises(CacheFullError, match="the cap is .* held by datasets in use"):
        stager.stage(b.uri)
    for lock in in_use:
        lock.close()
    assert stager.stage(b.uri).evicted  # free again


def test_worker_under_an_agent_waits_instead_of_staging(tmp_path: Path, dataset: Path, bucket: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    uri = f"s3://{bucket}/shapes/data.yaml"
    upload_dataset(dataset, f"s3://{bucket}/shapes", {})
    monkeypatch.setenv("ELASTICYOLO_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("ELASTICYOLO_DATA_STAGER", "agent")
    with pytest.raises(StagingError, match="not staged on this node after 0.5s"):
        resolve_data_yaml(uri, wait_s=0.5)
    assert not any((tmp_path / "cache").glob("*/files")), "a worker under an agent staged by itself"
    Stager(DatasetCache(tmp_path / "cache")).stage(uri)  # the agent's staging
    assert resolve_data_yaml(uri, wait_s=0.5).is_file()


def test_verification_without_an_md5_etag(tmp_path: Path) -> None:
    """SSE-KMS objects' ETags are no MD5 (real S3): their full-object checksum is used, else the size."""
    import base64
    import hashlib

    from elasticyolo.staging.stager import SourceRef, RemoteObject

    body = b"x" * 1000
    sha = base64.b64encode(hashlib.sha256(body).digest()).decode()

    class Client:
        head: dict[str, str] = {}

        def head_object(self, **kw: object) -> dict[str, str]:
            return self.head

    path = tmp_path / "obj"
    path.write_bytes(body)
    ref, obj = SourceRef.parse("s3://bkt/p/data.yaml"), RemoteObject("obj", 1000, "f" * 32)
    stager = Stager(DatasetCache(tmp_path), client=Client())
    Client.head = {"ServerSideEncryption": "aws:kms", "ChecksumSHA256": sha}
    assert stager._verify(ref, obj, path) == (None, "checksum")
    Client.head = {"ServerSideEncryption": "aws:kms"}
    assert stager._verify(ref, obj, path) == (None, "size-only")
    Client.head = {"ServerSideEncryption": "aws:kms", "ChecksumSHA256": base64.b64encode(b"0" * 32).decode()}
    assert "SHA256 mismatch" in str(stager._verify(ref, obj, path)[0])
    Client.head = {}
    assert "corrupt copy" in str(stager._verify(ref, obj, path)[0])
    assert "size 1000 != 999" in str(stager._verify(ref, RemoteObject("obj", 999, "f" * 32), path)[0])


def test_data_cli(tmp_path: Path, dataset: Path, bucket: str) -> None:
    from elasticyolo.local_cluster.agents import ELASTICYOLO

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ELASTICYOLO, "data", *args], capture_output=True, text=True, timeout=60)

    for uri, needle in ((f"s3://{bucket}/nope/data.yaml", "no such object"),
                        ("s3://no-such-bucket-9/x/data.yaml", "bucket 'no-such-bucket-9' does not exist"),
                        (f"s3://{bucket}/x/", "expected s3://bucket/prefix/data.yaml")):
        r = run("stage", uri, "--cache", str(tmp_path / "c"))
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 2 and len(lines) == 1 and needle in lines[0], r.stderr
    r = run("upload", str(dataset), f"s3://{bucket}/cli", "--sse", "AES256")
    assert r.returncode == 0 and "train with data=s3://" in r.stdout, r.stderr
    head = boto3.client("s3").head_object(Bucket=bucket, Key="cli/data.yaml")
    assert head["ServerSideEncryption"] == "AES256"
    r = run("stage", f"s3://{bucket}/cli/data.yaml", "--json", "--cache", str(tmp_path / "c"))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["files"] == len(_files(dataset)) and Path(out["data_yaml"]).is_file()
