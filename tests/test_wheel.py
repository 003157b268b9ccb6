"""The wheel and the node install, for real: the wheel is built from this tree, installed by
deploy/common/bootstrap.sh (`install` mode) into a fresh venv made from the system's Python, and
that venv's own agent and `status` run against a real etcd, without torch. The [train] extra is
resolved by pip (a dry run against the package index): it names torch and Ultralytics in range and
no test package.

The base dependencies come from a wheelhouse pip fills once from the index
(~/.cache/elasticyolo/wheelhouse/): later runs install offline (pip --no-index), in seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Iterator

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from elasticyolo.local_cluster.servers import EtcdCluster
from elasticyolo.local_cluster.wait import wait_for
from support.wheel import (BOOTSTRAP, REPO, TEST_PACKAGES, build_wheel, canonical, clean_env,
                                       installed_packages, system_python)

WHEELHOUSE = Path(os.environ.get("ELASTICYOLO_WHEELHOUSE", Path.home() / ".cache" / "elasticyolo" / "wheelhouse"))
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    built = build_wheel(tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("build"))
    assert built.name == f"elasticyolo-{PROJECT['version']}-py3-none-any.whl"
    return built


@pytest.fixture(scope="module")
def node_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """bootstrap.sh's install step, agent and CLI only (ELASTICYOLO_EXTRAS empty), from the wheelhouse."""
    venv = tmp_path_factory.mktemp("node") / "venv"
    python = system_python()
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    env = clean_env(ELASTICYOLO_VENV=str(venv), ELASTICYOLO_PYTHON=python, ELASTICYOLO_EXTRAS="",
                     PIP_NO_INDEX="1", PIP_FIND_LINKS=str(WHEELHOUSE), PIP_NO_COMPILE="1")

    def install() -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(BOOTSTRAP), "install", str(wheel)], env=env, capture_output=True,
                              text=True, timeout=600)

    r = install()
    if r.returncode != 0 and "No matching distribution found" in r.stderr:
        # The wheelhouse lacks a dependency (first run, or pyproject changed): fill it from the index.
        fill = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "download", "--quiet", "--only-binary=:all:",
                               "-d", str(WHEELHOUSE), str(wheel)],
                              env=clean_env(), capture_output=True, text=True, timeout=600)
        assert fill.returncode == 0, fill.stderr[-3000:]
        r = install()
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    yield venv


def test_the_wheel_gives_the_agent_and_the_cli_without_torch(node_venv: Path, etcd_server: EtcdCluster,
                                                              job_name: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = node_venv / "bin"
    env = clean_env(ELASTICYOLO_LOG_FORMAT="json", ELASTICYOLO_WORK_DIR=str(tmp_path / "work"))
    monkeypatch.chdir(tmp_path)  # not this checkout: `python -c` would import ./elasticyolo
    # the installed package, not this checkout
    r = subprocess.run([str(bin_dir / "python"), "-c", "import elasticyolo; print(elasticyolo.__file__)"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith(str(node_venv)), r.stdout + r.stderr
    r = subprocess.run([str(bin_dir / "python"), "-c", "import torch"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "No module named 'torch'" in r.stderr, r.stderr
    r = subprocess.run([str(bin_dir / "elasticyolo"), "agent", "--help"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--etcd" in r.stdout, r.stderr
    # training is worker-side: the CLI says what to install
    r = subprocess.run([str(bin_dir / "elasticyolo"), "data", "synth", "--out", str(tmp_path / "shapes"),
                        "--train", "4", "--val", "2", "--imgsz", "32"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([str(bin_dir / "elasticyolo"), "train", "model=yolov8n.yaml",
                        f"data={tmp_path}/shapes/data.yaml", "epochs=1"], env=env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "needs the Python package 'torch'" in r.stderr and "elasticyolo[train]" in r.stderr, \
        r.stdout + r.stderr

    # the wheel's agent registers in a real etcd, and its `status` shows it
    log = open(tmp_path / "agent.log", "ab")
    agent = subprocess.Popen([str(bin_dir / "elasticyolo"), "agent", "--config", os.devnull, "--etcd",
                              etcd_server.endpoints, "--job", job_name, "--node-id", "wheel-node", "--addr",
                              "127.0.0.1", "--host", "127.0.0.1", "--slots", "1", "--ttl", "2"],
                             env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    log.close()
    try:
        def registered() -> dict | None:  # type: ignore[type-arg]
            s = subprocess.run([str(bin_dir / "elasticyolo"), "status", "--etcd", etcd_server.endpoints, "--job",
                                job_name, "--json"], env=env, capture_output=True, text=True, timeout=30)
            assert s.returncode == 0, s.stderr
            view = json.loads(s.stdout)
            # registration and the election are two steps: wait for both
            return view if [n["id"] for n in view["nodes"]] == ["wheel-node"] and view["leader"] == "wheel-node" \
                else None

        wait_for(registered, 60, "the wheel's agent registered and leading in `status --json`",
                 abort=lambda: f"the agent exited {agent.returncode}" if agent.poll() is not None else None)
        text = subprocess.run([str(bin_dir / "elasticyolo"), "status", "--etcd", etcd_server.endpoints, "--job",
                               job_name], env=env, capture_output=True, text=True, timeout=30)
        assert text.returncode == 0 and "wheel-node" in text.stdout, text.stderr
    finally:
        agent.terminate()
        agent.wait(30)
    assert agent.returncode == 0, (tmp_path / "agent.log").read_text()[-3000:]

    # pip installed no test package into the venv, and no torch
    installed = installed_packages(bin_dir / "python", env)
    assert "elasticyolo" in installed and not installed & TEST_PACKAGES and "torch" not in installed, installed
    # what a node installs from the wheel, beside the package: the unit and the clouds' drop-ins as shipped
    share = node_venv / "share" / "elasticyolo"
    assert (share / "systemd" / "elasticyolo-agent.service").read_text() == \
        (REPO / "systemd" / "elasticyolo-agent.service").read_text()
    assert (share / "gcp" / "elasticyolo-agent.service.d" / "gcs.conf").is_file()
    assert (share / "build_horovod.sh").read_text() == (REPO / "scripts" / "build_horovod.sh").read_text()
    assert (node_venv / "share" / "doc" / "elasticyolo" / "agent.md").is_file()
    # a venv that sees the image's packages (a GPU image's torch)
    assert "include-system-site-packages = true" in (node_venv / "pyvenv.cfg").read_text()


def test_the_train_extra_names_torch_in_range_and_no_test_package(wheel: Path, tmp_path: Path) -> None:
    """pip's own resolution of `<wheel>[train]`, as on a node without torch (a dry run: nothing is
    downloaded past the metadata)."""
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--only-binary=:all:", "--report", str(report), f"{wheel}[train]"],
                       env=clean_env(), capture_output=True, text=True, timeout=600)
    if r.returncode != 0 and any(s in r.stderr for s in ("NewConnectionError", "Could not fetch URL",
                                                         "Temporary failure in name resolution")):
        pytest.skip(f"the package index is unreachable: {r.stderr.strip().splitlines()[-1]}")
    assert r.returncode == 0, r.stderr[-3000:]
    resolved = {canonical(i["metadata"]["name"]): Version(i["metadata"]["version"])
                for i in json.loads(report.read_text())["install"]}
    assert not set(resolved) & TEST_PACKAGES, sorted(set(resolved) & TEST_PACKAGES)
    train = [Requirement(s) for s in PROJECT["optional-dependencies"]["train"]]
    for req in train:
        name = canonical(req.name)
        assert name in resolved, name
        assert resolved[name] in req.specifier, (name, resolved[name], str(req.specifier))
    # ranges, not pins: a GPU image's torch inside them is kept
    by_name = {canonical(r.name): r for r in train}
    for name in ("torch", "torchvision"):
        spec = by_name[name].specifier
        assert not any(s.operator == "==" for s in spec) and any(s.operator == "<" for s in spec), str(spec)
    assert "ultralytics" in resolved and "horovod" not in resolved
