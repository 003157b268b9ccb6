"""deploy/ validated offline: files parse, shell scripts pass shellcheck, cloud-init user data
renders and passes `cloud-init schema`, the agent config inside it is a valid agent config, the
AWS requests match botocore's service models, the IAM policy lets a node do exactly its work
(the local S3 server enforcing it), and the etcd member unit is hardened. The etcd scripts
themselves run for real in the TLS/auth cluster tests (test_production_cluster.py)."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import string
import subprocess
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions
import pytest
import requests
import yaml

from elasticyolo.config import load_agent_config

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
KMS = "arn:aws:kms:us-east-1:123456789012:key/00000000-0000-0000-0000-000000000000"


def test_every_file_parses() -> None:
    files = [p for p in DEPLOY.rglob("*") if p.is_file()]
    assert len(files) >= 20
    for p in files:
        if p.suffix == ".json":
            json.loads(p.read_text())
        elif p.suffix in (".yaml", ".yml") or p.name.endswith(".yml.template"):
            assert yaml.safe_load(p.read_text()) is not None, p
        elif p.suffix == ".sh":
            assert p.read_text().startswith("#!/usr/bin/env bash\n") and os.access(p, os.X_OK), p


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shell_scripts_pass_shellcheck() -> None:
    scripts = sorted(str(p) for p in DEPLOY.rglob("*.sh"))
    r = subprocess.run(["shellcheck", "-x", *scripts], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
def test_deploy_wheel_step_builds_the_committed_tree_under_the_configured_name(tmp_path: Path) -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    name = f"elasticyolo-{version}-py3-none-any.whl"
    script = f'set -euo pipefail; . "{DEPLOY}/common/build-wheel.sh"; build_wheel'
    env = {**os.environ, "ROOT": str(REPO), "TMPDIR": str(tmp_path)}
    other = "s3://b/wheels/elasticyolo-0.0.9-py3-none-any.whl"
    r = subprocess.run(["bash", "-c", script], env={**env, "ELASTICYOLO_WHEEL": other}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode != 0 and f"built {name}, but ELASTICYOLO_WHEEL names elasticyolo-0.0.9" in r.stderr, r.stderr
    r = subprocess.run(["bash", "-c", script], env={**env, "ELASTICYOLO_WHEEL": f"s3://b/wheels/{name}"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    built = Path(r.stdout.strip())
    assert built.name == name
    names = zipfile.ZipFile(built).namelist()
    assert f"elasticyolo-{version}.data/data/share/elasticyolo/systemd/elasticyolo-agent.service" in names
    assert not any(n.startswith(("tests/", "bench/")) for n in names)


def _render(cloud: str, out: Path) -> Path:
    config = DEPLOY / cloud / "cluster.env.example"
    r = subprocess.run(["bash", str(DEPLOY / cloud / "deploy.sh"), str(config), "render", str(out)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for f in out.iterdir():
        assert "${" not in f.read_text(), f"unrendered placeholder in {f.name}"
    return out


def _write_files(cloud_init: Path) -> dict[str, str]:
    doc = yaml.safe_load(cloud_init.read_text())
    out = {}
    for f in doc["write_files"]:
        content, encoding = f["content"], f.get("encoding")
        if encoding == "b64":
            content = base64.b64decode(content).decode()
        elif encoding == "gz+b64":
            content = gzip.decompress(base64.b64decode(content)).decode()
        else:
            assert encoding is None, encoding
        out[f["path"]] = content
    return out


@pytest.mark.parametrize("cloud", ["aws", "gcp"])
def test_cloud_init_renders_validates_and_carries_a_valid_agent_config(cloud: str, tmp_path: Path) -> None:
    out = _render(cloud, tmp_path / "out")
    user_data = out / "cloud-init.yaml"
    assert user_data.read_text().startswith("#cloud-config\n")
    if shutil.which("cloud-init"):
        r = subprocess.run(["cloud-init", "schema", "--config-file", str(user_data)], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "Valid cloud-config" in r.stdout, r.stdout + r.stderr
    assert len(user_data.read_bytes()) < 16384  # EC2 takes at most 16 KB of user data
    files = _write_files(user_data)
    assert files["/usr/local/sbin/elasticyolo-bootstrap"] == (DEPLOY / "common" / "bootstrap.sh").read_text()
    doc = yaml.safe_load(user_data.read_text())
    assert doc["runcmd"] == [["/usr/local/sbin/elasticyolo-bootstrap", cloud]]
    assert "git" not in doc["packages"]  # a node installs the wheel, not a checkout
    # the node install's settings: the wheel in the bucket, the default engine only, no Horovod wheel
    env = dict(line.split("=", 1) for line in files["/etc/elasticyolo/bootstrap.env"].splitlines() if line)
    scheme = {"aws": "s3", "gcp": "gs"}[cloud]
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert env["ELASTICYOLO_WHEEL"] == f"{scheme}://my-elasticyolo-bucket/wheels/elasticyolo-{version}-py3-none-any.whl"
    assert env["ELASTICYOLO_ENGINES"] == "torch" and env["HOROVOD_WHEEL"] == ""
    # the agent config it writes, with its /etc/elasticyolo files stood in for by temp files
    etc = tmp_path / "etc"
    (etc / "pki").mkdir(parents=True)
    for name in ("pki/ca.pem", "pki/client-agent.pem", "pki/client-agent-key.pem", "etcd-password"):
        (etc / name).write_text("x\n")
    cfg_path = tmp_path / "agent.yaml"
    cfg_path.write_text(files["/etc/elasticyolo/agent.yaml"].replace("/etc/elasticyolo/", f"{etc}/"))
    cfg = load_agent_config(str(cfg_path), {}, environ={})
    assert cfg.tls() and cfg.etcd_user == "elasticyolo" and cfg.etcd_password == "x"
    assert len(cfg.etcd) == 3 and all(e.startswith("https://") for e in cfg.etcd)
    assert cfg.spot_provider == cloud and cfg.data_cache_max_gb == 200
    if cloud == "aws":
        assert cfg.s3_sse == "aws:kms" and cfg.s3_kms_key_id and cfg.s3_region
    else:
        assert cfg.s3_endpoint_url == "https://storage.googleapis.com" and cfg.s3_sse is None
        drop_in = (DEPLOY / "gcp" / "elasticyolo-agent.service.d" / "gcs.conf").read_text()
        assert "LoadCredential=gcs-hmac:/etc/elasticyolo/gcs-hmac" in drop_in
        assert "AWS_SHARED_CREDENTIALS_FILE=%d/gcs-hmac" in drop_in


def _validate(service: str, operation: str, params: dict[str, Any]) -> None:
    import botocore.session
    from botocore.validate import ParamValidator

    model = botocore.session.get_session().get_service_model(service).operation_model(operation)
    report = ParamValidator().validate(params, model.input_shape)
    assert not report.has_errors(), report.generate_report()


def test_aws_requests_match_the_service_models(tmp_path: Path) -> None:
    out = _render("aws", tmp_path / "out")
    lt = json.loads((out / "launch-template.json").read_text())
    _validate("ec2", "CreateLaunchTemplate", lt)
    assert base64.b64decode(lt["LaunchTemplateData"]["UserData"]).decode() == (out / "cloud-init.yaml").read_text()
    assert lt["LaunchTemplateData"]["MetadataOptions"]["HttpTokens"] == "required"  # IMDSv2 only
    asg = json.loads((out / "asg.json").read_text())
    _validate("autoscaling", "CreateAutoScalingGroup", asg)
    policy = asg["MixedInstancesPolicy"]
    assert policy["InstancesDistribution"]["SpotAllocationStrategy"] == "capacity-optimized"
    assert policy["InstancesDistribution"]["OnDemandBaseCapacity"] >= 1  # one non-preemptible leader
    assert len({o["InstanceType"] for o in policy["LaunchTemplate"]["Overrides"]}) >= 4
    assert asg["CapacityRebalance"] is True
    assert policy["LaunchTemplate"]["LaunchTemplateSpecification"]["Version"] == "$Latest"
    _validate("s3", "PutBucketLifecycleConfiguration",
              {"Bucket": "b", "LifecycleConfiguration": json.loads((out / "s3-lifecycle.json").read_text())})
    _validate("iam", "CreateRole", {"RoleName": "r", "AssumeRolePolicyDocument": (DEPLOY / "aws" / "trust-policy.json").read_text()})


def _policy(bucket: str) -> str:
    return string.Template((DEPLOY / "aws" / "iam-policy.json").read_text()).substitute(
        BUCKET=bucket, DATASET_PREFIX="datasets", CHECKPOINT_PREFIX="checkpoints", KMS_KEY_ARN=KMS,
        REGION="us-east-1", ACCOUNT_ID="123456789012", CLUSTER="prod")


def test_iam_policy_is_least_privilege() -> None:
    doc = json.loads(_policy("bkt"))
    for st in doc["Statement"]:
        assert st["Effect"] == "Allow"
        actions = st["Action"] if isinstance(st["Action"], list) else [st["Action"]]
        assert all("*" not in a for a in actions), st
        resources = st["Resource"] if isinstance(st["Resource"], list) else [st["Resource"]]
        for res in resources:
            assert "*" not in res.split(":::")[-1].split("/")[0], st  # never a wildcard bucket
            assert res.endswith(("/datasets/*", "/checkpoints/*", "/wheels/*")) or res in (
                "arn:aws:s3:::bkt", KMS) or res.startswith("arn:aws:ssm:us-east-1:123456789012:parameter/elasticyolo/prod/"), res
    writes = [st for st in doc["Statement"] if "s3:PutObject" in st["Action"]]
    assert len(writes) == 1 and writes[0]["Resource"].endswith("/checkpoints/*")  # datasets are read-only


def test_iam_policy_enforced_by_the_s3_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node with exactly this policy stages a dataset and writes and lists checkpoints (multipart,
    SSE-KMS); it cannot write datasets or read outside its prefixes. (moto enforces actions and
    resources; it ignores conditions, which real IAM applies on top.)"""
    from elasticyolo.checkpoint.stores import open_store
    from elasticyolo.data.synth import SynthSpec, write_dataset
    from elasticyolo.local_cluster.servers import S3Server
    from elasticyolo.staging.cache import DatasetCache
    from elasticyolo.staging.stager import Stager
    from elasticyolo.staging.upload import upload_dataset

    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with S3Server() as srv:
        def client(service: str, key: str, secret: str) -> Any:
            return boto3.client(service, endpoint_url=srv.endpoint_url, region_name="us-east-1",
                                aws_access_key_id=key, aws_secret_access_key=secret)

        boot = client("iam", "testing", "testing")
        boot.create_user(UserName="admin")
        boot.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}))
        admin_key = boot.create_access_key(UserName="admin")["AccessKey"]
        # from here on every request is authenticated and authorized against IAM
        requests.post(f"{srv.endpoint_url}/moto-api/reset-auth", data=b"0", timeout=10).raise_for_status()
        admin = (admin_key["AccessKeyId"], admin_key["SecretAccessKey"])
        s3_admin, iam_admin = client("s3", *admin), client("iam", *admin)
        s3_admin.create_bucket(Bucket="bkt")
        s3_admin.put_object(Bucket="bkt", Key="other/secret.txt", Body=b"not for nodes")
        for k, v in {"AWS_ACCESS_KEY_ID": admin[0], "AWS_SECRET_ACCESS_KEY": admin[1],
                     "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(k, v)
        ds = write_dataset(tmp_path / "shapes", SynthSpec(train=4, val=2, imgsz=32)).parent
        upload_dataset(ds, "s3://bkt/datasets/shapes", {"endpoint_url": srv.endpoint_url})
        iam_admin.create_user(UserName="node")
        iam_admin.put_user_policy(UserName="node", PolicyName="elasticyolo", PolicyDocument=_policy("bkt"))
        node_key = iam_admin.create_access_key(UserName="node")["AccessKey"]
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", node_key["AccessKeyId"])
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", node_key["SecretAccessKey"])

        # what a node does: stage, checkpoint (incl. a multipart upload), list, prune
        result = Stager(DatasetCache(tmp_path / "cache"), {"endpoint_url": srv.endpoint_url}).stage(
            "s3://bkt/datasets/shapes/data.yaml")
        assert result.files > 0
        store = open_store("s3://bkt/checkpoints", endpoint_url=srv.endpoint_url, sse="aws:kms", kms_key_id=KMS,
                           multipart_threshold=5 << 20, multipart_chunksize=5 << 20, retries=1)
        store.check(write=True)
        import io

        blob = os.urandom(11 << 20)
        store.put_file("job/ckpt/1.pt", io.BytesIO(blob), len(blob))
        store.put_bytes("job/manifests/1.json", b"{}", if_none_match=True)
        assert [o.key for o in store.list("job/")] == ["job/ckpt/1.pt", "job/manifests/1.json"]
        # (Pruning uses DeleteObjects, which AWS authorizes per key with s3:DeleteObject on
        # checkpoints/*; moto checks it against the bucket instead, so it is not exercised here.)

        # and nothing more
        node = client("s3", node_key["AccessKeyId"], node_key["SecretAccessKey"])
        for call in (lambda: node.put_object(Bucket="bkt", Key="datasets/shapes/evil.txt", Body=b"x"),
                     lambda: node.delete_object(Bucket="bkt", Key="datasets/shapes/data.yaml"),
                     lambda: node.get_object(Bucket="bkt", Key="other/secret.txt"),
                     lambda: node.put_object(Bucket="bkt", Key="other/x", Body=b"x")):
            with pytest.raises(botocore.exceptions.ClientError, match="AccessDenied"):
                call()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None or shutil.which("etcd") is None,
                    reason="systemd-analyze and etcd needed")
def test_etcd_member_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    unit = tmp_path / "etcd-member.service"
    shutil.copy(DEPLOY / "etcd" / "etcd-member.service", unit)
    r = subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "etcd-member" not in r.stdout + r.stderr, r.stdout + r.stderr
    r = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
                       capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for etcd-member.service: ([0-9.]+) (\w+)", r.stdout + r.stderr)
    assert m is not None and float(m.group(1)) <= 2.0, r.stdout[-2000:]


def test_gcp_roles_are_narrow() -> None:
    for name in ("role-dataset-reader.yaml", "role-checkpoint-writer.yaml"):
        role = yaml.safe_load((DEPLOY / "gcp" / name).read_text())
        perms = role["includedPermissions"]
        assert perms and all(re.fullmatch(r"storage\.(objects|multipartUploads)\.\w+", p) for p in perms), perms
    reader = yaml.safe_load((DEPLOY / "gcp" / "role-dataset-reader.yaml").read_text())["includedPermissions"]
    assert set(reader) == {"storage.objects.get", "storage.objects.list"}
    script = (DEPLOY / "gcp" / "deploy.sh").read_text()
    assert "objectListPrefix" in script and "--provisioning-model SPOT" in script
    assert "--instance-selection-machine-types" in script
