"""A third engine through the engine interface alone: `tests/plugins/tiny_engine.py`, registered
with `ELASTICYOLO_ENGINES` (no edit to elasticyolo), run by real `elasticyolo agent` processes on
the real etcd. The agents look the engine up from the spec, `elasticyolo worker` dispatches to its
worker, which trains the real model on the shared worker runner; status shows its progress and
last checkpoint, a SIGKILLed agent takes its worker along, a drain goes through the shared drain
executor, a restarted node resumes from its node-local snapshot, and the job ends `done`. A
plug-in that lacks a required part of the interface is refused with one line."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

from elasticyolo.cluster.etcd import EtcdClient
from elasticyolo.cluster.jobs import submit_spec
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.engines import names, registry
from elasticyolo.engines.base import Engine
from elasticyolo.errors import UserError
from elasticyolo.local_cluster.agents import ELASTICYOLO, AgentProcess, nodes_in_etcd
from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.processes import running
from elasticyolo.spec import TrainSpec

PLUGINS = Path(__file__).resolve().parent / "plugins"
ENGINES = "tiny=tiny_engine:ENGINE"
EPOCHS = 6
STEPS_PER_EPOCH = 4  # 8 images, batch 2, one node's world of one


@pytest.fixture
def plugin_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(PLUGINS), os.environ.get("PYTHONPATH", "")) if p)
    monkeypatch.setenv(registry.ENV_ENGINES, ENGINES)  # this process validates the spec too
    monkeypatch.syspath_prepend(str(PLUGINS))
    return {registry.ENV_ENGINES: ENGINES, "PYTHONPATH": path}


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[dict[str, AgentProcess]]:
    started: dict[str, AgentProcess] = {}
    yield started
    for a in started.values():
        a.stop(timeout=20)


def status(endpoints: str, job: str, env: dict[str, str]) -> dict[str, Any]:
    import subprocess

    out = subprocess.run([ELASTICYOLO, "status", "--etcd", endpoints, "--job", job, "--json"], capture_output=True,
                         text=True, timeout=30, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout))


def workers_of(agent: AgentProcess) -> list[int]:
    assert agent.proc is not None
    return [p.pid for p in psutil.Process(agent.proc.pid).children(recursive=True)]


def snapshot_step(path: Path) -> int:
    from elasticyolo.train.snapshots import read_snapshot
    from elasticyolo.train.state import state_step

    state = read_snapshot(path)
    assert state is not None, path
    return state_step(state)


def gone(pid: int) -> bool:
    return not running(pid)


def test_registry_knows_the_plugin_and_loads_it_lazily(plugin_env: dict[str, str]) -> None:
    assert registry.names()[:2] == ["horovod", "torch"] and "tiny" in registry.names()
    engine = registry.get("tiny")
    assert isinstance(engine, Engine) and engine.name == "tiny" and engine is registry.get("tiny")
    with pytest.raises(Exception, match="Input should be 'horovod', 'torch', 'ray' or 'tiny'"):
        TrainSpec.from_pairs(["data=d.yaml", "engine=mpi"])


class NoWorkerModules(Engine):
    name = "partial"
    commit_target_s = 1.0

    def node(self, agent: Any) -> Any:
        raise NotImplementedError

    def worker_main(self, spec: Any, options: Any) -> int:
        return 0


class NotAnEngine:
    name = "duck"
    commit_target_s = 1.0
    worker_modules = ()


INCOMPLETE = NoWorkerModules()


@pytest.fixture
def in_process_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines registered by a test are this test's only."""
    monkeypatch.setattr(registry, "_registered", {})
    monkeypatch.setattr(names, "_in_process", {})


@pytest.mark.usefixtures("in_process_registry")
def test_a_plugin_that_lacks_a_required_part_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UserError) as lacking:
        registry.register(NoWorkerModules())
    assert "lacks worker_modules" in str(lacking.value) and "\n" not in str(lacking.value)
    with pytest.raises(UserError, match="refused: a NotAnEngine, not an elasticyolo.engines.base.Engine") as duck:
        registry.register(NotAnEngine())
    assert "\n" not in str(duck.value)
    assert "partial" not in registry.names() and "duck" not in registry.names()
    # Registered by name, it is refused when first loaded, before any agent runs it.
    monkeypatch.setenv(registry.ENV_ENGINES, f"partial={__name__}:INCOMPLETE")
    with pytest.raises(UserError, match=r"engine 'partial' \(.*:INCOMPLETE\) is refused: it lacks worker_modules"):
        registry.get("partial")


@pytest.mark.usefixtures("in_process_registry")
def test_a_complete_plugin_registers_in_process() -> None:
    class Complete(NoWorkerModules):
        name = "complete"
        worker_modules = ()

    engine = registry.register(Complete())
    assert registry.get("complete") is engine and "complete" in registry.names()
    assert engine.plan_drain.__func__ is Engine.plan_drain  # type: ignore[attr-defined]  # the optional part's default


def test_third_engine_runs_under_real_agents(etcd_server, job_name: str, tmp_path: Path, plugin_env: dict[str, str],
                                             agents: dict[str, AgentProcess]) -> None:
    ep = etcd_server.endpoints
    client, keys = EtcdClient(ep), JobKeys(job_name)
    data = write_dataset(tmp_path / "data", SynthSpec(train=8, val=2, imgsz=32, classes=1))
    store = f"file://{tmp_path / 'store'}"
    env = {**plugin_env, "ELASTICYOLO_WORK_DIR": str(tmp_path / "nodes"), "OMP_NUM_THREADS": "1"}

    def start(node: str) -> AgentProcess:
        agents[node] = AgentProcess(ep, job_name, node, ttl=2, log_dir=tmp_path, env=env).start()
        return agents[node]

    a, b = start("a"), start("b")
    spec = TrainSpec.from_pairs([f"data={data}", "engine=tiny", f"epochs={EPOCHS}", "commit_every=4", "imgsz=32",
                                 "batch=2", "nbs=2", "val=false", "workers=0", "warmup_epochs=0", "close_mosaic=0",
                                 f"checkpoint={store}", "save_period_steps=0", "checkpoint_nice=0"])
    assert submit_spec(client, keys, spec, by="test")

    # Both nodes train the tiny engine's job; status shows its progress and last checkpoint.
    view = wait_for(lambda: (lambda v: v if v["state"] == "running" and (v["step"] or 0) >= 4
                             and (v["last_checkpoint"] or {}).get("step") else None)(status(ep, job_name, env)),
                    180, "status to show the tiny job running with a step and a checkpoint")
    assert view["epoch"] is not None and view["samples_s"] and view["last_checkpoint"]["uri"].startswith("file://")
    assert view["last_resume"]["reason"] == "start"
    assert {n["state"] for n in view["nodes"]} == {"TRAINING"}
    assert any(r.get("event") == "engine selected" and r.get("engine") == "tiny" for r in a.log_records())

    # SIGKILL of an agent takes its worker down (die-with-parent through the spawn helper).
    a_workers = wait_for(lambda: workers_of(a), 10, "a's worker")
    a.kill()
    wait_for(lambda: all(gone(p) for p in a_workers), 10, "a's worker to die with its agent")

    # A drain (SIGTERM) stops b's worker through the shared drain executor (plan: stop).
    b_workers = workers_of(b)
    assert b_workers
    step_before = snapshot_step(wait_for(lambda: next((tmp_path / "nodes" / job_name / "b").glob(
        "*/snapshots/state.pt"), None), 30, "b's node-local snapshot"))
    b.signal(signal.SIGTERM)
    assert b.proc is not None and b.proc.wait(30) == 0
    # The worker's own helper processes (its checkpoint uploader) end once their parent has gone.
    wait_for(lambda: all(gone(p) for p in b_workers), 10, "b's worker and its helpers to end")
    ends = [json.loads(v) for _, v, _ in client.get_prefix(keys.events) if json.loads(v).get("kind") == "drain_end"]
    assert ends and ends[-1]["node"] == "b" and ends[-1]["mode"] == "stop", ends
    assert "b" not in nodes_in_etcd(client, job_name)

    # b comes back: its worker resumes from its node-local state and the job runs to the end.
    start("b")
    resumed = wait_for(lambda: (lambda r: r if r and r.get("reason") == "restore" and r["at"] > ends[-1]["at"]
                                else None)(client.get_json(keys.resume)), 120, "b's worker to resume")
    assert resumed["step"] >= step_before > 0
    wait_for(lambda: status(ep, job_name, env)["state"] == "done", 180, "the tiny job to finish")
    final = status(ep, job_name, env)
    total = EPOCHS * STEPS_PER_EPOCH
    assert final["step"] == total and final["last_checkpoint"]["step"] == total, final
    wait_for(lambda: nodes_in_etcd(client, job_name).get("b", {}).get("state") == "IDLE", 15, "b IDLE after the job")
