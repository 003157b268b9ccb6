"""Checkpoint stores against a real S3 API (moto_server on 127.0.0.1) and a directory."""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Iterator

import boto3
import pytest

from elasticyolo.checkpoint.stores import PreconditionFailed, open_store
from elasticyolo.errors import UnavailableError, UserError
from elasticyolo.local_cluster.servers import S3Server, free_port

os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def s3env(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[S3Server]:
    for k, v in s3_server.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    yield s3_server


@pytest.fixture
def bucket(s3env: S3Server, request: pytest.FixtureRequest) -> str:
    import re

    name = "st-" + re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower())[:40].strip("-")
    boto3.client("s3").create_bucket(Bucket=name)
    return name


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_store_operations(kind: str, bucket: str, tmp_path: Path) -> None:
    uri = f"s3://{bucket}/some/prefix" if kind == "s3" else f"file://{tmp_path}/store"
    opts = dict(multipart_threshold=5 * 1024 * 1024, multipart_chunksize=5 * 1024 * 1024, sse="AES256") \
        if kind == "s3" else {}
    store = open_store(uri, **opts)
    store.check(write=True)
    store.put_bytes("j/m/a.json", b"{}", if_none_match=True)
    with pytest.raises(PreconditionFailed):
        store.put_bytes("j/m/a.json", b"{}", if_none_match=True)
    data = os.urandom(11 * 1024 * 1024)  # above the threshold: multipart through the transfer manager
    store.put_file("j/c/b.pt", io.BytesIO(data), len(data), metadata={"sha256": "x"})
    info = store.head("j/c/b.pt")
    assert info is not None and info.size == len(data)
    if kind == "s3":
        assert info.metadata == {"sha256": "x"}
        head = boto3.client("s3").head_object(Bucket=bucket, Key="some/prefix/j/c/b.pt")
        assert head["ServerSideEncryption"] == "AES256"
    assert store.head("j/c/none") is None
    out = io.BytesIO()
    store.download("j/c/b.pt", out)
    assert out.getvalue() == data
    assert [o.key for o in store.list("j/")] == ["j/c/b.pt", "j/m/a.json"]
    store.delete(["j/m/a.json", "j/never"])
    assert [o.key for o in store.list("")] == ["j/c/b.pt"]


@pytest.mark.parametrize("checksums", ["when_supported", "when_required"])
def test_single_put_carries_our_sha256_as_its_checksum(checksums: str, bucket: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import base64
    import hashlib

    monkeypatch.setenv("AWS_REQUEST_CHECKSUM_CALCULATION", checksums)
    store = open_store(f"s3://{bucket}/p")
    data = os.urandom(1024 * 1024)
    digest = hashlib.sha256(data).hexdigest()
    store.put_file("j/c/one.pt", io.BytesIO(data), len(data), metadata={"sha256": digest}, sha256=digest)
    head = boto3.client("s3").head_object(Bucket=bucket, Key="p/j/c/one.pt", ChecksumMode="ENABLED")
    sent = head.get("ChecksumSHA256")
    if checksums == "when_supported":  # S3 checks the body against the manifest's hash
        assert sent == base64.b64encode(bytes.fromhex(digest)).decode()
    else:  # turned off for servers that reject checksums: none sent, ours neither
        assert sent is None and "ChecksumCRC32" not in head
    out = io.BytesIO()
    store.download("j/c/one.pt", out)
    assert out.getvalue() == data


@pytest.mark.parametrize("uri, words", [
    ("", "empty URI"),
    ("s3:///prefix", "no bucket"),
    ("s3://Bad_Bucket!/x", "not a valid S3 bucket name"),
    ("gs://bucket/x", "unsupported scheme"),
    ("/abs/path", "file:///abs/path"),
    ("file://relative/path", "absolute path"),
])
def test_bad_uri_one_line(uri: str, words: str) -> None:
    with pytest.raises(UserError) as err:
        open_store(uri)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_missing_bucket_one_line(s3env: S3Server) -> None:
    with pytest.raises(UserError) as err:
        open_store("s3://no-such-bucket-here/x").check()
    msg = str(err.value)
    assert "bucket 'no-such-bucket-here' does not exist" in msg and "\n" not in msg


def test_unreachable_endpoint_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UnavailableError) as err:
        open_store("s3://bucket/x", endpoint_url=url).check()
    assert "cannot reach S3" in str(err.value) and url in str(err.value) and "\n" not in str(err.value)


def test_no_credentials_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, s3_server: S3Server) -> None:
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    with pytest.raises(UserError) as err:
        open_store("s3://bucket/x", endpoint_url=s3_server.endpoint_url).check()
    assert "no AWS credentials" in str(err.value)
    with pytest.raises(UserError) as err:
        open_store("s3://bucket/x", profile="nope").check()
    assert "nope" in str(err.value) and "\n" not in str(err.value)


def test_denied_credentials_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    # A moto server that enforces IAM: unknown access keys are rejected like on AWS.
    monkeypatch.setenv("INITIAL_NO_AUTH_ACTION_COUNT", "0")
    with S3Server() as srv:
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG1")
        with pytest.raises(UserError) as err:
            open_store("s3://bucket/x").check()
    msg = str(err.value)
    assert "access denied" in msg and "\n" not in msg and not isinstance(err.value, UnavailableError)


def test_file_store_errors(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("x")
    with pytest.raises(UserError, match="not a directory"):
        open_store(f"file://{f}").check()
    with pytest.raises(UserError, match="apply to s3"):
        open_store(f"file://{tmp_path}", endpoint_url="http://x")
    open_store(f"file://{tmp_path}/new/dir").check(write=True)
    assert (tmp_path / "new" / "dir").is_dir()
