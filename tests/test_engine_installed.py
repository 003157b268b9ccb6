"""Horovod is an optional install: a node without it trains engine=torch jobs and refuses
engine=horovod ones with one line that `elasticyolo status` shows.

The node "without Horovod" is a real `elasticyolo agent` whose PYTHONPATH starts with a directory
holding a `horovod` package that fails to import, so every import of Horovod on that node (the
agent's check, the CLI, the torch workers) goes through the real import system and fails there.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import psutil
import pytest

from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.engines.horovod.engine import ENGINE as HOROVOD
from elasticyolo.engines.installed import RECORD_FIELD, engine_refusal, refusal
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.wait import wait_for

HINT = "pip install 'elasticyolo[horovod]', see docs/install.md"
REFUSAL = f"engine horovod is not installed here ({HINT})"
# Short torch rendezvous timeouts (as tests/test_torch_engine.py): one node forms its world at once.
RDZV_CONF = "join_timeout=120,last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=4,read_timeout=60"


# ---- the decision ------------------------------------------------------------------------------
def test_a_node_refuses_an_engine_only_when_a_required_module_is_missing() -> None:
    assert refusal("horovod", [], HINT) is None
    assert refusal("horovod", ["horovod.torch"], HINT) == REFUSAL
    assert refusal("plain", ["x"], "") == "engine plain is not installed here"
    assert HOROVOD.requires == ("horovod.torch",)
    assert engine_refusal(HOROVOD, installed=lambda module: False) == REFUSAL
    assert engine_refusal(HOROVOD, installed=lambda module: True) is None


def test_horovod_discovery_gives_a_refusing_node_no_slots() -> None:
    pytest.importorskip("horovod.torch")
    from elasticyolo.engines.horovod.discovery import slots_of

    record = {"state": "IDLE", "slots": 2}
    assert slots_of(record, None) == 2
    assert slots_of({**record, RECORD_FIELD: REFUSAL}, None) == 0


# ---- a node without Horovod --------------------------------------------------------------------
@pytest.fixture
def no_horovod(tmp_path: Path) -> str:
    """A PYTHONPATH on which `import horovod` fails, as on a node installed without it."""
    shadow = tmp_path / "no-horovod"
    (shadow / "horovod").mkdir(parents=True)
    (shadow / "horovod" / "__init__.py").write_text(
        'raise ImportError("horovod is not installed on this node (test shadow)")\n')
    return os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture
def node_without_horovod(etcd_server, job_name: str, tmp_path: Path, no_horovod: str) -> Iterator[AgentCluster]:
    """Agents and CLI calls with Horovod unimportable (the fixture's PYTHONPATH)."""
    c = AgentCluster(etcd_server.endpoints, job_name, tmp_path,
                     env={"PYTHONPATH": no_horovod, "OMP_NUM_THREADS": "1", "ELASTICYOLO_TORCH_RDZV_CONF": RDZV_CONF})
    yield c
    c.stop()


def spec_pairs(data: Path, engine: str) -> list[str]:
    pairs = {"model": "yolov8n.yaml", "data": str(data), "epochs": 100, "imgsz": 64, "batch": 4, "nbs": 8,
             "warmup_epochs": 0, "close_mosaic": 0, "val": "false", "engine": engine, "commit_every": 2,
             "amp": "false"}
    return [f"{k}={v}" for k, v in pairs.items()]


def test_a_node_without_horovod_refuses_a_horovod_job_and_trains_a_torch_job(
        node_without_horovod: AgentCluster, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    cluster = node_without_horovod
    data = write_dataset(tmp_path / "data", SynthSpec(train=16, val=4, imgsz=64, classes=2))

    # The CLI submits a Horovod job without Horovod on its machine (it does not train).
    cluster.submit(*spec_pairs(data, "horovod"))
    agent = cluster.start("n2")
    wait_for(lambda: cluster.nodes().get("n2", {}).get(RECORD_FIELD), 30, "n2 refuses the Horovod job")

    view = cluster.status()
    (n2,) = view["nodes"]
    assert n2["refused"] == REFUSAL
    assert f"  node n2: {REFUSAL}" in cluster.status(as_json=False).splitlines()
    assert agent.proc is not None and agent.proc.poll() is None  # the agent keeps serving
    assert psutil.Process(agent.proc.pid).children(recursive=True) == []  # and starts no worker
    assert cluster.events() == []

    # The same node trains a torch job: its agent and workers never import Horovod.
    cluster.submit("--replace", *spec_pairs(data, "torch"))
    wait_for(lambda: len({e["step"] for e in cluster.steps()}) >= 3, 180, "n2 trains 3 steps of the torch job")
    assert RECORD_FIELD not in cluster.nodes()["n2"]
    assert [n["refused"] for n in cluster.status()["nodes"]] == [None]
