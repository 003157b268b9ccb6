"""S3 options from the job spec / agent config reach every put (multipart uploads too), checked on
the server side; the etcd password travels as a file (systemd credential), never as a value."""

from __future__ import annotations

import io
import os
from pathlib import Path

import boto3
import pytest

from elasticyolo.checkpoint import manager_for_spec, open_store
from elasticyolo.cluster.secrets import PASSWORD_ENV, PASSWORD_FILE_ENV, child_password_env, password_from_env
from elasticyolo.config import load_agent_config
from elasticyolo.errors import UserError
from elasticyolo.local_cluster.servers import S3Server
from elasticyolo.s3options import s3_options
from elasticyolo.spec import TrainSpec

KMS = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"


def test_spec_and_agent_settings_resolve_to_store_options(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    spec = TrainSpec.from_pairs(["data=d.yaml", "checkpoint=s3://b1/p", "s3_sse=aws:kms", f"s3_kms_key_id={KMS}",
                                 "s3_region=eu-west-1"])
    assert s3_options(spec.checkpoint, spec, {}) == {"sse": "aws:kms", "kms_key_id": KMS, "region": "eu-west-1"}
    # the agent's defaults (exported to workers as ELASTICYOLO_S3_*) fill what the job leaves out
    env = {"ELASTICYOLO_S3_ENDPOINT_URL": "http://127.0.0.1:9", "ELASTICYOLO_S3_SSE": "AES256"}
    assert s3_options("s3://b1/p", spec, env)["endpoint_url"] == "http://127.0.0.1:9"
    assert s3_options("s3://b1/p", spec, env)["sse"] == "aws:kms"  # the job's own value wins
    assert s3_options("file:///x", spec, env) == {}  # file stores take no S3 options
    for bad, needle in ((["s3_sse=AES256", f"s3_kms_key_id={KMS}"], "needs s3_sse=aws:kms"),
                        (["s3_sse=aes"], "s3_sse: Input should be"),
                        (["s3_endpoint_url=minio:9000"], r"is not an http\(s\) URL")):
        with pytest.raises(UserError, match=needle):
            TrainSpec.from_pairs(["data=d.yaml", *bad])
    cfg_file = tmp_path / "agent.yaml"
    cfg_file.write_text("etcd: [127.0.0.1:2379]\ns3_sse: aws:kms\ns3_kms_key_id: k1\ns3_region: us-east-2\n")
    cfg = load_agent_config(str(cfg_file), {}, environ={})
    assert cfg.s3_env() == {"ELASTICYOLO_S3_SSE": "aws:kms", "ELASTICYOLO_S3_KMS_KEY_ID": "k1",
                            "ELASTICYOLO_S3_REGION": "us-east-2"}


def test_every_put_carries_sse_multipart_included(s3: S3Server) -> None:
    client = boto3.client("s3")
    client.create_bucket(Bucket="sse-every-put")
    spec = TrainSpec.from_pairs(["data=d.yaml", "checkpoint=s3://sse-every-put/runs", "s3_sse=aws:kms",
                                 f"s3_kms_key_id={KMS}"])
    manager = manager_for_spec(spec, "job1")  # what a worker builds from the spec it was given
    assert manager is not None
    store = manager.store
    store.check(write=True)
    store.put_bytes("job1/manifests/m.json", b"{}", if_none_match=True)
    # the same options with a small multipart threshold: CreateMultipartUpload carries the SSE
    mp = open_store(spec.checkpoint, **s3_options(spec.checkpoint, spec), multipart_threshold=5 << 20,
                    multipart_chunksize=5 << 20)
    data = os.urandom(11 << 20)
    mp.put_file("job1/ckpt/big.pt", io.BytesIO(data), len(data))
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="sse-every-put")["Contents"]]
    assert "runs/job1/ckpt/big.pt" in keys and "runs/job1/manifests/m.json" in keys
    for key in keys:
        head = client.head_object(Bucket="sse-every-put", Key=key)
        assert head["ServerSideEncryption"] == "aws:kms" and head["SSEKMSKeyId"] == KMS, key
    assert client.head_object(Bucket="sse-every-put", Key="runs/job1/ckpt/big.pt")["ETag"].endswith('-3"')


def test_password_reaches_children_as_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {PASSWORD_ENV: "s3cret", "OTHER": "x"}
    child = child_password_env("s3cret", None, env)
    assert PASSWORD_ENV not in env  # the value is not inherited
    path = Path(child[PASSWORD_FILE_ENV])
    assert path.read_text() == "s3cret\n" and (path.stat().st_mode & 0o777) == 0o600
    assert password_from_env(child) == "s3cret"
    pw = tmp_path / "pw"
    pw.write_text("from-file\nignored\n")
    assert child_password_env("from-file", str(pw), {}) == {PASSWORD_FILE_ENV: str(pw)}
    assert child_password_env(None, None, {}) == {}

    # systemd LoadCredential=: the password found by name; a file setting read from its copy
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "etcd-password").write_text("from-credential\n")
    (creds / "client-agent-key.pem").write_text("KEY")
    root_only = tmp_path / "etc" / "client-agent-key.pem"
    root_only.parent.mkdir()
    root_only.write_text("unreadable for the service")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    cfg_file = tmp_path / "agent.yaml"
    cfg_file.write_text(f"etcd: [127.0.0.1:2379]\netcd_user: elasticyolo\netcd_cert: {root_only}\n"
                        f"etcd_key: {root_only}\n")
    cfg = load_agent_config(str(cfg_file), {}, environ={})
    assert cfg.etcd_password == "from-credential" and cfg.etcd_password_file == str(creds / "etcd-password")
    assert cfg.etcd_key == str(creds / "client-agent-key.pem")
    assert password_from_env({"CREDENTIALS_DIRECTORY": str(creds)}) == "from-credential"
    assert "from-credential" not in repr(cfg)
    with pytest.raises(UserError, match="etcd password file .*: empty"):
        (tmp_path / "empty").write_text("")
        password_from_env({PASSWORD_FILE_ENV: str(tmp_path / "empty")})
