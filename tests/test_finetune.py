"""Fine-tuning: `model=s3://.../weights.pt` (staged once per node, verified), `pretrained=` and
`freeze=` with Ultralytics' meanings. Nothing comes from a hub: the weights are trained here, one
epoch from a yaml on generated data, and fine-tuned from.

Frozen tensors (parameters and their layers' BatchNorm statistics) must come out of training bit
for bit as they went in: through `elasticyolo train`, and through rollbacks, restores and
checkpoints, in the core, and through two agents with a node killed mid-run."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import boto3
import pytest
import torch

from elasticyolo.checkpoint import open_store
from elasticyolo.checkpoint.catalog import list_manifests
from elasticyolo.checkpoint.format import load_checkpoint_file
from elasticyolo.checkpoint.restore import download_verified
from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.errors import UserError
from elasticyolo.processes import running
from elasticyolo.spec import TrainSpec
from elasticyolo.staging.cache import DatasetCache
from elasticyolo.staging.stager import StagingError, Stager, resolve_for_spec
from support.pty import run_on_pty
from elasticyolo.local_cluster.servers import S3Server

ELASTICYOLO = str(Path(sys.executable).with_name("elasticyolo"))
FROZEN = 10  # freeze=10: yolov8n's backbone (layers 0-9)


def run(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([ELASTICYOLO, *args], capture_output=True, text=True, timeout=timeout, cwd=cwd,
                          env={**os.environ, **(env or {})})


def frozen_entries(state: dict[str, torch.Tensor], layers: int = FROZEN) -> dict[str, torch.Tensor]:
    """The state entries of layers 0..layers-1: parameters and BatchNorm statistics."""
    return {k: v for k, v in state.items() if k.startswith(tuple(f"model.{i}." for i in range(layers)))}


def assert_bit_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys() and got, what
    differ = [k for k in got if not torch.equal(got[k].cpu(), want[k].cpu())]
    assert not differ, f"{what}: {len(differ)} frozen tensors changed, e.g. {differ[:3]}"


def source_state(weights: Path) -> dict[str, torch.Tensor]:
    """What a fine-tune starts from: the checkpoint's EMA module (Ultralytics loads `ema` first)."""
    ckpt = torch.load(weights, map_location="cpu", weights_only=False)
    return {k: v.float() if v.is_floating_point() else v for k, v in ckpt["ema"].state_dict().items()}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=16, val=4, imgsz=64, classes=2))


@pytest.fixture(scope="module")
def weights(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Weights trained here: one epoch of yolov8n.yaml, saved as a checkpoint YOLO(path) loads."""
    work = tmp_path_factory.mktemp("weights")
    r = run("train", "model=yolov8n.yaml", f"data={data}", "epochs=1", "imgsz=64", "batch=8", "workers=0",
            "val=false", "--save", str(work / "w.pt"), cwd=work)
    assert r.returncode == 0, r.stderr[-3000:]
    return work / "w.pt"


@pytest.fixture
def bucket(s3: S3Server, request: pytest.FixtureRequest) -> str:
    name = "ft-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[-40:].strip("-")
    boto3.client("s3").create_bucket(Bucket=name)
    return name


# ---- the spec ------------------------------------------------------------------------------------
@pytest.mark.parametrize("words, freeze, pretrained", [
    (["freeze=10"], 10, None),
    (["freeze=0,1,2"], [0, 1, 2], None),
    (["freeze=[0, 1, 22.cv2]"], [0, 1, "22.cv2"], None),
    (["freeze=none"], None, None),
    (["pretrained=w.pt"], None, "w.pt"),
    (["pretrained=s3://bkt/a/w.pt", "freeze=3"], 3, "s3://bkt/a/w.pt"),
    (["model=s3://bkt/k/w.pt", "pretrained=false"], None, "false"),
    (["model=w.pt", "pretrained=True"], None, "true"),
])
def test_spec_takes_fine_tuning_options(words: list[str], freeze: Any, pretrained: Any) -> None:
    spec = TrainSpec.from_pairs(["data=d.yaml", *words])
    assert (spec.freeze, spec.pretrained) == (freeze, pretrained)
    assert TrainSpec.from_json(spec.to_json(), "etcd") == spec  # as a job spec travels to the nodes
    assert spec.ultralytics_overrides()["freeze"] == freeze


@pytest.mark.parametrize("words, needle", [
    (["freeze=-1"], "freeze: '-1' is not a layer count"),
    (["freeze=true"], "freeze: 'true' is not a layer count"),
    (["freeze=0,x"], "freeze: 'x' in '0,x' is not a layer index"),
    (["pretrained=true"], "pretrained=true: model=yolov8n.yaml is an architecture without weights"),
    (["pretrained=weights"], "pretrained: 'weights' is not a weights file"),
    (["pretrained=s3://bkt/x.yaml"], "pretrained: 's3://bkt/x.yaml' is not a weights file"),
    (["model=s3://bkt/k/w.yaml"], "an s3:// model must be a weights file"),
    (["model=s3://Bad_Bucket/w.pt"], "'Bad_Bucket' is not a valid S3 bucket name"),
    (["model=s3:///w.pt"], "expected s3://bucket/key.pt"),
])
def test_spec_refuses_bad_fine_tuning_options_in_one_line(words: list[str], needle: str) -> None:
    with pytest.raises(UserError) as err:
        TrainSpec.from_pairs(["data=d.yaml", *words])
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_cfg_file_with_ultralytics_defaults_is_accepted(tmp_path: Path) -> None:
    """A copy of Ultralytics' default.yaml says `pretrained: True` and `freeze: None`: the defaults."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("pretrained: True\nfreeze: None\nepochs: 3\n")
    spec = TrainSpec.from_pairs(["data=d.yaml", f"cfg={cfg}"])
    assert (spec.pretrained, spec.freeze, spec.epochs) == (None, None, 3)
    cfg.write_text("freeze: [0, 1]\n")
    assert TrainSpec.from_pairs(["data=d.yaml", f"cfg={cfg}"]).freeze == [0, 1]


# ---- weights from S3 -----------------------------------------------------------------------------
def test_weights_staged_once_verified_and_kept_apart(bucket: str, tmp_path: Path) -> None:
    s3 = boto3.client("s3")
    body_a, body_b = b"PK\x03\x04" + b"a" * 5000, b"PK\x03\x04" + b"b" * 7000
    s3.put_object(Bucket=bucket, Key="models/a.pt", Body=body_a)
    s3.put_object(Bucket=bucket, Key="models/b.pt", Body=body_b)
    s3.put_object(Bucket=bucket, Key="models/a.pt.bak", Body=b"x" * 100)  # a neighbour: not staged
    s3.put_object(Bucket=bucket, Key="models/notes.pt", Body=b"these are not weights")
    cache = DatasetCache(tmp_path / "cache")
    stager = Stager(cache)
    first = stager.stage(f"s3://{bucket}/models/a.pt")
    assert first.path.read_bytes() == body_a and first.path.name == "a.pt"
    assert (first.files, first.downloaded_files, first.verified) == (1, 1, {"md5": 1})
    again = stager.stage(f"s3://{bucket}/models/a.pt")
    assert again.reused and again.downloaded_bytes == 0 and again.path == first.path
    other = stager.stage(f"s3://{bucket}/models/b.pt")  # same folder, its own cache entry
    assert other.path.read_bytes() == body_b and other.path != first.path and first.path.read_bytes() == body_a
    assert sorted(p.name for p in first.path.parent.iterdir()) == ["a.pt"]
    with pytest.raises(StagingError, match=rf"^weights s3://{bucket}/models/missing.pt: no such object$"):
        stager.stage(f"s3://{bucket}/models/missing.pt")
    with pytest.raises(StagingError, match="models/notes.pt: not a PyTorch checkpoint"):
        stager.stage(f"s3://{bucket}/models/notes.pt")


def test_a_single_process_stages_the_specs_weights_too(bucket: str, tmp_path: Path, data: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ELASTICYOLO_DATA_CACHE", str(tmp_path / "cache"))
    boto3.client("s3").put_object(Bucket=bucket, Key="w/m.pt", Body=b"PK\x03\x04" + b"m" * 100)
    boto3.client("s3").put_object(Bucket=bucket, Key="w/p.pt", Body=b"PK\x03\x04" + b"p" * 100)
    spec = TrainSpec.from_pairs([f"data={data}", f"model=s3://{bucket}/w/m.pt", f"pretrained=s3://{bucket}/w/p.pt"])
    assert resolve_for_spec(spec) is None  # the dataset is local
    from elasticyolo.models import local_weights

    assert local_weights(spec.model, "model", spec).read_bytes().endswith(b"m" * 100)
    assert local_weights(str(spec.pretrained), "pretrained", spec).read_bytes().endswith(b"p" * 100)


def test_bad_weights_get_one_line_errors_at_train(bucket: str, data: Path, tmp_path: Path, s3: S3Server) -> None:
    boto3.client("s3").put_object(Bucket=bucket, Key="junk.pt", Body=b"<html>not found</html>")
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"\x00" * 64)
    env = {**s3.env(), "ELASTICYOLO_DATA_CACHE": str(tmp_path / "cache")}
    for words, needle in [
        ([f"model=s3://{bucket}/missing.pt"], f"model=s3://{bucket}/missing.pt: no such object"),
        ([f"model=s3://{bucket}/junk.pt"], f"model=s3://{bucket}/junk.pt: not a PyTorch checkpoint"),
        ([f"model={junk}"], f"model={junk}: not a PyTorch checkpoint"),
        ([f"pretrained=s3://{bucket}/missing.pt"], f"pretrained=s3://{bucket}/missing.pt: no such object"),
        (["pretrained=true"], "pretrained=true: model=yolov8n.yaml is an architecture without weights"),
        (["freeze=all"], "freeze: 'all' is not a layer count"),
    ]:
        r = run("train", f"data={data}", "epochs=1", *words, cwd=tmp_path, env=env)
        assert r.returncode == 2, (words, r.stderr[-2000:])
        # The error is one line, the last (staging logs its progress before it).
        assert needle in r.stderr.splitlines()[-1] and "Traceback" not in r.stderr, (words, r.stderr[-2000:])
    # At a terminal too: the one line, and no traceback.
    code, out = run_on_pty([ELASTICYOLO, "train", f"data={data}", f"model={junk}"], timeout=60, cwd=tmp_path)
    assert code == 2 and f"model={junk}: not a PyTorch checkpoint" in out and "Traceback" not in out, out


def test_bad_weights_and_freeze_found_where_the_model_is_built(weights: Path, data: Path, tmp_path: Path) -> None:
    """What only the model can tell (checked on the worker, and by `elasticyolo train`)."""
    from elasticyolo.train.weights import build_model

    not_ultralytics = tmp_path / "state.pt"
    torch.save({"weights": torch.zeros(3)}, not_ultralytics)
    for words, needle in [
        ([f"pretrained={tmp_path / 'nope.pt'}"], f"pretrained={tmp_path / 'nope.pt'}: file not found on this node"),
        ([f"model={not_ultralytics}"], f"model={not_ultralytics}: not a checkpoint Ultralytics can load"),
        (["model=yolov8n.yaml", f"pretrained={not_ultralytics}"], "not a checkpoint Ultralytics can load"),
        ([f"model={weights}", "freeze=23"], "freeze=23: the model has 23 layers (layers 0-22); freezing them all"),
        (["freeze=0,30"], "freeze=[0, 30]: layer 30 does not exist (the model has layers 0-22)"),
    ]:
        spec = TrainSpec.from_pairs([f"data={data}", *words])
        with pytest.raises(UserError) as err:
            build_model(spec, 2, {0: "a", 1: "b"})
        assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_pretrained_transfers_matching_weights_into_a_yaml(weights: Path, data: Path) -> None:
    from elasticyolo.train.weights import build_model

    src = source_state(weights)
    model = build_model(TrainSpec.from_pairs([f"data={data}", f"pretrained={weights}"]), 3, {0: "a", 1: "b", 2: "c"})
    state = model.state_dict()
    same = [k for k in state if k in src and src[k].shape == state[k].shape and torch.equal(state[k], src[k])]
    assert len(same) > 0.9 * len(state), (len(same), len(state))  # all but the 3-class head's last convs
    scratch = build_model(TrainSpec.from_pairs([f"data={data}", f"model={weights}", "pretrained=false"]), 2,
                          {0: "a", 1: "b"})
    assert not torch.equal(scratch.state_dict()["model.0.conv.weight"], src["model.0.conv.weight"])


# ---- training keeps frozen tensors -------------------------------------------------------------
def test_core_keeps_frozen_tensors_through_steps_rollback_and_checkpoint(weights: Path, data: Path) -> None:
    from elasticyolo.train.core import TrainCore
    from elasticyolo.train.state import build_core_checkpoint, core_state, load_core_checkpoint, load_core_state

    spec = TrainSpec.from_pairs([f"model={weights}", f"data={data}", "epochs=2", "imgsz=64", "batch=4", "nbs=4",
                                 "workers=0", "val=false", "warmup_epochs=0", "freeze=10", "optimizer=AdamW"])
    core = TrainCore(spec)
    src = frozen_entries(source_state(weights))
    frozen_params = [p for n, p in core.model.named_parameters() if n in src]
    assert frozen_params and not any(p.requires_grad for p in frozen_params)
    assert not {id(p) for p in frozen_params} & {id(p) for p in core.trainable}
    core.warm_up()
    saved = core_state(core)
    for _ in range(3):
        core.train_step()
    assert core.model.training and core.frozen_norms
    modules = dict(core.model.named_modules())
    assert all(not modules[n].training for n in core.frozen_norms)  # their statistics do not move
    assert modules["model.12.cv1.bn"].training  # a trained layer's do
    state = core.model.state_dict()
    assert_bit_identical(frozen_entries(state), src, "model after 3 steps")
    assert_bit_identical(frozen_entries(core.ema.ema.state_dict()), src, "EMA after 3 steps")
    assert not torch.equal(state["model.12.cv1.conv.weight"], saved["model"]["model.12.cv1.conv.weight"])
    # The optimizer holds no state for frozen parameters (AdamW: no moments, no weight decay).
    assert not any(id(p) in {id(q) for q in frozen_params} for p in core.optimizer.state)
    ckpt = build_core_checkpoint(core)
    load_core_state(core, saved)  # a rollback
    assert_bit_identical(frozen_entries(core.model.state_dict()), src, "model after a rollback")
    core.train_step()
    load_core_checkpoint(core, ckpt)  # a restore from a checkpoint
    core.train_step()
    assert_bit_identical(frozen_entries(core.model.state_dict()), src, "model after a restore")
    assert_bit_identical(frozen_entries(core.ema.ema.state_dict()), src, "EMA after a restore")
    core.close()


def test_train_cli_fine_tunes_with_frozen_layers(weights: Path, data: Path, tmp_path: Path) -> None:
    r = run("train", f"model={weights}", f"data={data}", "epochs=2", "imgsz=64", "batch=4", "workers=0",
            "freeze=10", "close_mosaic=1", "--save", str(tmp_path / "f.pt"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "done: epochs=2" in r.stdout
    ckpt = torch.load(tmp_path / "f.pt", map_location="cpu", weights_only=False)
    src = source_state(weights)
    for part in ("model", "ema"):
        state = ckpt["elasticyolo"][part]
        assert_bit_identical(frozen_entries(state), frozen_entries(src), f"{part} after elasticyolo train")
        assert not torch.equal(state["model.22.cv2.0.0.conv.weight"], src["model.22.cv2.0.0.conv.weight"])
    assert ckpt["train_args"]["freeze"] == 10
    args = (tmp_path / "runs").rglob("args.yaml")
    assert any("freeze: 10" in a.read_text() for a in args)


def test_agent_says_why_weights_cannot_be_staged(cluster: Any, data: Path, bucket: str, tmp_path: Path) -> None:
    """A missing weights object: the node never offers its slots, and `status` says why."""
    uri = f"s3://{bucket}/models/missing.pt"
    c = cluster
    c.start("a", "--data-cache-dir", str(tmp_path / "cache-a"))
    c.wait(lambda: c.ready(["a"]) and c.leader(), 60, "an agent and a leader")
    c.submit(f"model={uri}", f"data={data}", "epochs=1", "imgsz=64", "val=false")
    failed = c.wait(lambda: (c.nodes()["a"].get("data") or {}).get("state") == "failed" and c.nodes()["a"]["data"],
                    60, "the node's staging to fail")
    assert failed["error"] == f"weights {uri}: no such object", failed
    assert [n["data"]["error"] for n in c.status()["nodes"]] == [failed["error"]]  # status --json
    assert not c.steps() and c.world().get("ranks") in (None, {})
    r = run("cancel", "--etcd", c.endpoints, "--job", c.job)  # the node goes back to IDLE: a quick stop
    assert r.returncode == 0, r.stderr
    c.wait(lambda: c.nodes()["a"]["state"] == "IDLE", 30, "the node idle")


# ---- through agents ------------------------------------------------------------------------------
# Loaded 2-core CI box: worker start-up (torch + Ultralytics import) can take ~30 s.
START_S, STEP_S = 240, 120


def cluster_spec(weights_uri: str, data: Path, checkpoints: str, epochs: int) -> list[str]:
    # 16 images, batch 4, nbs 4: 2 steps an epoch at world 2, 4 at world 1; a commit every step and
    # a checkpoint every 2, all kept, so every one of them can be checked.
    return ["engine=horovod", f"model={weights_uri}", f"data={data}", f"freeze={FROZEN}", f"epochs={epochs}", "imgsz=64", "batch=4",
            "nbs=4", "warmup_epochs=0", "close_mosaic=0", "commit_every=1", "val=false", "min_nodes=1",
            "gloo_timeout_s=5", "cooldown_s=1,4", f"checkpoint={checkpoints}", "save_period_steps=2",
            "keep_last=100"]


def stored_checkpoints(uri: str, job: str) -> list[tuple[Any, dict[str, Any]]]:
    """Every checkpoint of `job` in the store at `uri`, verified against its manifest, oldest first."""
    store = open_store(uri)
    out = []
    for m in list_manifests(store, job):
        buf = io.BytesIO()
        download_verified(store, m, buf)
        out.append((m, load_checkpoint_file(buf)))
    return out


def test_agents_keep_frozen_layers_through_a_killed_node(cluster: Any, weights: Path, data: Path, bucket: str,
                                                        tmp_path: Path) -> None:
    """Two agents fine-tune from weights in S3 with freeze=10 (Horovod, checkpoints to S3): each
    node stages the weights once; a node is SIGKILLed mid-run, the survivor rolls back to its last
    commit and trains on alone to the end. Every checkpoint of the run (the final one too) holds
    the frozen layers bit for bit as the weights file had them."""
    boto3.client("s3").upload_file(str(weights), bucket, "models/w.pt")
    uri, checkpoints = f"s3://{bucket}/models/w.pt", f"s3://{bucket}/ckpt"
    c = cluster
    for node in ("a", "b"):
        c.start(node, "--data-cache-dir", str(tmp_path / f"cache-{node}"))
    c.wait(lambda: c.ready(["a", "b"]) and c.leader(), 60, "two agents and a leader")
    c.submit(*cluster_spec(uri, data, checkpoints, epochs=8))
    c.wait(lambda: {e["rank"] for e in c.steps(world=2)} == {0, 1}, START_S, "both ranks training at world 2")
    for node, rec in c.nodes().items():  # staged by each node's agent, once, before it trained
        staged = rec["data"]
        assert (staged["uri"], staged["state"], staged["downloaded_files"]) == (uri, "ready", 1), (node, staged)
    c.wait(lambda: max(e["step"] for e in c.steps(world=2)) >= 2, STEP_S, "a commit and a checkpoint at world 2")
    victim = next(n for n in ("b", "a") if n != c.leader())
    children = c.kill(victim)
    t_kill = time.time()
    c.wait(lambda: not any(running(p) for p in children), 10, f"{victim}'s workers to die with their agent")
    c.wait(lambda: [e for e in c.steps(world=1) if e["t"] > t_kill], STEP_S, "a step at world 1 after the kill")
    assert [e for e in c.events() if e["ev"] == "resume" and e["world"] == 1 and e["t"] > t_kill]  # a rollback
    c.wait(lambda: c.job_state() in ("done", "failed"), 600, "the job to finish")
    assert c.job_state() == "done"

    src = source_state(weights)
    saved = stored_checkpoints(checkpoints, c.job)
    assert len(saved) >= 3 and saved[-1][0].reason == "final", [m.reason for m, _ in saved]
    for manifest, ckpt in saved:
        for part in ("model", "ema"):
            assert_bit_identical(frozen_entries(ckpt["elasticyolo"][part]), frozen_entries(src),
                                 f"{part} of the checkpoint at step {manifest.step}")
    final = saved[-1][1]["elasticyolo"]["model"]
    assert not torch.equal(final["model.22.cv2.0.0.conv.weight"], src["model.22.cv2.0.0.conv.weight"])
    assert final["model.12.cv1.bn.running_mean"].ne(src["model.12.cv1.bn.running_mean"]).any()
