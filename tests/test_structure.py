"""The package's structure rules, checked from the source: no import cycles, no import up a layer,
the agent side stays torch-free, one rule each for job names, spot providers, the worker
environment and die-with-parent, and the docs cite only files that exist."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from elasticyolo.local_cluster.wait import wait_for
from elasticyolo.processes import running

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "elasticyolo"


# ---- imports ----------------------------------------------------------------------------------
def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported elasticyolo module: line}, counting every import statement: top level,
    inside functions (lazy) and under `if TYPE_CHECKING:` alike."""
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for mod, path in mods.items():
        edges: dict[str, int] = {}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                found = resolve(target)
                if found and found != mod:
                    edges.setdefault(found, node.lineno)
        graph[mod] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_inside_the_package() -> None:
    graph = import_graph()
    assert len(graph) > 50 and "elasticyolo.engines.names" in graph["elasticyolo.spec"]
    found = cycles(graph)
    detail = ["; ".join(f"{a} -> {b} (line {graph[a][b]})" for a in comp for b in graph[a] if b in comp)
              for comp in found]
    assert not found, "import cycles: " + " | ".join(detail)


def test_the_cycle_check_finds_a_cycle() -> None:
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


# ---- layers -------------------------------------------------------------------------------------
# The package's layers, lowest first. A module imports only from its own layer and the layers
# below it, lazily or not. A module belongs to the layer of the longest entry that names it or a
# package above it (`engines.names`, the engine registry's table, is below the rest of `engines`:
# the spec checks engine names against it, while `engines.registry`, which loads an engine and
# checks it is an `engines.base.Engine`, sits with the engines; `worker_runtime.worker_env` is below the rest of `worker_runtime`: it is the
# environment contract that `config.py` and `train/` read too).
LAYERS: list[set[str]] = [
    # foundations: errors, logging, processes, S3 options, prices; the tensor memory layout (torch only)
    {"elasticyolo", "errors", "log", "yamlfile", "priority", "processes", "exit_hooks", "mp", "s3options",
     "weights_file", "run_layout", "cost", "train.layout"},
    {"checkpoint.stores"},  # object stores: s3://, file://
    {"staging"},  # s3:// datasets and weights staged into a node cache
    # what a job is: the spec, its weights, its engine's name; whether a node has that engine installed
    {"models", "spec", "engines.names", "engines.installed"},
    {"cluster", "spot"},  # etcd (keys, jobs, nodes, election, liveness) and the clouds' interruption notices
    {"checkpoint"},  # checkpoints: format, manager, restore, catalog
    {"config", "worker_runtime.worker_env"},  # the agent's configuration and the workers' environment
    {"report"},  # a run's timeline
    {"data", "train"},  # the engine-neutral training core
    {"worker_runtime"},  # what every engine's workers run on: spawn, lifeline, zygote, warm pool, progress
    {"status"},  # the job as `elasticyolo status` shows it
    {"agent"},  # the node daemon and its plug-ins
    {"engines"},  # the engine interface and the engines
    {"local_cluster", "chaos", "demo"},  # a cluster on 127.0.0.1; the demo and the chaos replay run on it
    {"commands", "cli"},  # the command line
]


def layer_of(module: str, layers: list[set[str]] = LAYERS) -> int:
    """The index of `module`'s layer in `layers` (entries relative to `elasticyolo`)."""
    best: tuple[int, int] | None = None  # (entry length, layer)
    for index, entries in enumerate(layers):
        for entry in entries:
            name = "elasticyolo" if entry == "elasticyolo" else f"elasticyolo.{entry}"
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > best[0]):
                best = (len(name), index)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best[1]


def imports_up_a_layer(graph: dict[str, dict[str, int]], layers: list[set[str]] = LAYERS) -> list[str]:
    return sorted(f"{a} -> {b} (line {line})" for a, edges in graph.items() for b, line in edges.items()
                  if layer_of(b, layers) > layer_of(a, layers))


def test_no_import_runs_up_a_layer() -> None:
    graph = import_graph()
    up = imports_up_a_layer(graph)
    assert not up, "imports that run up a layer (see LAYERS): " + "; ".join(up)


def test_the_layer_check_finds_an_import_up_a_layer() -> None:
    layers = [{"log"}, {"cluster"}, {"engines"}]
    graph = {"elasticyolo.log": {}, "elasticyolo.cluster.etcd": {"elasticyolo.log": 3},
             "elasticyolo.engines.node": {"elasticyolo.cluster.etcd": 5},
             "elasticyolo.cluster.jobs": {"elasticyolo.engines.node": 9}}
    assert imports_up_a_layer(graph, layers) == ["elasticyolo.cluster.jobs -> elasticyolo.engines.node (line 9)"]


def test_agent_side_imports_no_torch() -> None:
    code = ("import sys\n"
            "import elasticyolo.commands.agent, elasticyolo.commands.status, elasticyolo.commands.worker\n"
            "import elasticyolo.agent.daemon, elasticyolo.engines.dispatch\n"
            "from elasticyolo.engines import registry\n"
            "for name in registry.names():\n"
            "    engine = registry.get(name)\n"
            "    engine.node.__call__\n"
            "import elasticyolo.engines.horovod.node, elasticyolo.engines.torch.node, elasticyolo.engines.drain\n"
            "import elasticyolo.commands.ray_jobs, elasticyolo.engines.ray.job, elasticyolo.engines.ray.records\n"
            "sys.exit(1 if 'torch' in sys.modules or 'ultralytics' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0


# ---- one rule each --------------------------------------------------------------------------------
def test_one_job_name_rule() -> None:
    from elasticyolo.checkpoint.layout import check_job
    from elasticyolo.cluster.keys import JobKeys, check_job_name
    from elasticyolo.config import load_agent_config
    from elasticyolo.errors import UserError

    for good in ("MyRun", "coco-2024.v1_a", "a" * 128):
        assert check_job(good) == check_job_name(good) == JobKeys(good).job == good
        assert load_agent_config(os.devnull, {"etcd": "127.0.0.1:2379", "job": good}, environ={}).job == good
    for bad in ("Bad Name", "a/b", ".hidden", "", "a" * 129):
        with pytest.raises(UserError) as keys_err:
            check_job_name(bad)
        with pytest.raises(UserError) as layout_err:
            check_job(bad)
        assert str(keys_err.value) == str(layout_err.value)


def test_agent_and_train_accept_the_same_job_name(tmp_path: Path) -> None:
    elasticyolo = str(Path(sys.executable).with_name("elasticyolo"))
    agent = subprocess.run([elasticyolo, "agent", "--config", os.devnull, "--etcd", "127.0.0.1:1", "--job", "MyRun",
                            "--startup-timeout-s", "0"], capture_output=True, text=True, timeout=60)
    assert "job name" not in agent.stderr and agent.returncode == 3, agent.stderr  # only etcd is missing
    ckpt = subprocess.run([elasticyolo, "checkpoints", "list", "--job", "MyRun", "--store", f"file://{tmp_path}"],
                          capture_output=True, text=True, timeout=60)
    assert ckpt.returncode == 0 and "has no checkpoints" in ckpt.stdout, ckpt.stderr


def test_one_spot_provider_list() -> None:
    import argparse

    from elasticyolo.commands import agent
    from elasticyolo.config import load_agent_config
    from elasticyolo.errors import UserError
    from elasticyolo.spot import make_watcher
    from elasticyolo.spot.providers import PROVIDERS

    parser = argparse.ArgumentParser()
    agent.add_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "spot_provider")
    assert tuple(action.choices) == PROVIDERS  # type: ignore[arg-type]
    for name in PROVIDERS:
        assert load_agent_config(os.devnull, {"etcd": "127.0.0.1:2379", "spot_provider": name.upper()},
                                 environ={}).spot_provider == name
    with pytest.raises(UserError, match=", ".join(PROVIDERS)):
        load_agent_config(os.devnull, {"etcd": "127.0.0.1:2379", "spot_provider": "oracle"}, environ={})
    with pytest.raises(UserError, match=", ".join(PROVIDERS)):
        make_watcher("oracle")


def test_worker_env_round_trip_and_one_set_of_names() -> None:
    from elasticyolo.cluster import settings
    from elasticyolo.commands import connect
    from elasticyolo.cluster.settings import EtcdSettings
    from elasticyolo.worker_runtime import worker_env
    from elasticyolo.worker_runtime.worker_env import WorkerEnv

    env = WorkerEnv(etcd=EtcdSettings("127.0.0.1:1,127.0.0.1:2", ca="/ca.pem", cert="/c.pem", key="/k.pem",
                                      user="u", password="secret"),
                    job="j", node_id="n", spec_json='{"data": "d"}', generation=42, worker_dir="/w", parent_pid=7,
                    term=3, restore=True, engine_config="{}", snapshot_period_s=2.5)
    written = env.to_env()
    assert worker_env.read(written) == env
    assert worker_env.read({}) == WorkerEnv()
    assert "secret" not in repr(env)
    assert "secret" not in written.values() and "ELASTICYOLO_ETCD_PASSWORD" not in written  # a file path only
    # The CLI reads the same variables the agent writes for its workers.
    cli_env = {dest: name for dest, (name, _) in connect._SOURCES.items()}
    assert cli_env["etcd"] == settings.ENV_ENDPOINTS and cli_env["etcd_ca"] == settings.ENV_CA == "ELASTICYOLO_ETCD_CA"
    assert {cli_env["etcd"], cli_env["etcd_ca"], cli_env["etcd_cert"], cli_env["etcd_key"], cli_env["etcd_user"],
            cli_env["job"]} <= set(written)


def test_no_log_call_passes_a_field_named_event() -> None:
    """structlog takes the message as `event`: a log call with an `event=` field raises TypeError
    when it runs, which in a daemon thread ends whatever that thread does."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("debug", "info", "warning", "error", "exception", "critical", "msg")
                    and any(k.arg == "event" for k in node.keywords)):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not found, found


# ---- die with the parent --------------------------------------------------------------------------
_CHILD = ("import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(float(sys.argv[2]));"
          "from elasticyolo.worker_runtime.lifeline import die_with_agent; die_with_agent();"
          "open(sys.argv[1] + '.armed', 'w').close(); time.sleep(60)")
# The parent starts the child through the spawn helper (its pid in the child's environment).
_PARENT = ("import sys, time; from elasticyolo.worker_runtime.spawn import spawn;"
           "spawn([sys.executable, '-c', sys.argv[1], sys.argv[2], sys.argv[3]], dict(__import__('os').environ),"
           " capture_output=False); time.sleep(float(sys.argv[4]))")


def _child_pid(path: Path) -> int:
    return int(wait_for(lambda: path.read_text().strip(), 30, "the child to write its pid"))


def _gone(pid: int) -> bool:
    return not running(pid)


def test_child_dies_with_its_parent(tmp_path: Path) -> None:
    pid_file = tmp_path / "child"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, str(pid_file), "0", "60"])
    try:
        child = _child_pid(pid_file)
        wait_for(lambda: Path(f"{pid_file}.armed").exists(), 30, "the child to arm its death signal")
        assert not _gone(child)
        parent.kill()
        parent.wait(10)
        wait_for(lambda: _gone(child), 10, "the child to die with its parent")
    finally:
        parent.kill()


def test_child_whose_parent_died_before_it_started_exits_at_once(tmp_path: Path) -> None:
    """The parent exits right after spawning; the child arms only 1 s later, already re-parented:
    comparing with the pid its parent wrote catches it (`getppid()` alone would not)."""
    pid_file = tmp_path / "child"
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, _CHILD, str(pid_file), "1.0", "0"])
    parent.wait(30)
    child = _child_pid(pid_file)
    wait_for(lambda: _gone(child), 15, "the orphaned child to exit instead of sleeping 60 s")


# ---- docs ---------------------------------------------------------------------------------------
# A cited file: a path with a directory and a file extension, e.g. `engines/horovod/driver.py`
# (relative to the repository, to the package, or to the document).
_PATH_RE = re.compile(r"(?<![\w/.<-])((?:\.\./)?[\w.-]+(?:/[\w.-]+)*/[\w.-]+\.(?:py|md|yaml|yml|sh|service|toml|cfg|txt))(?!\w|\.\w)")
_LINK_RE = re.compile(r"\]\(([^)#\s]+)")
# A bare module name (`launcher.py`): some file of the repository must have it.
_NAME_RE = re.compile(r"(?<![\w/.<-])([\w-]+\.py)\b")


def test_docs_cite_only_files_that_exist() -> None:
    docs = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    names = {p.name for d in ("elasticyolo", "tests", "bench", "scripts") for p in (REPO / d).rglob("*")}
    missing = []
    checked = 0
    for doc in docs:
        text = doc.read_text()
        cited = set(_PATH_RE.findall(text)) | {m for m in _LINK_RE.findall(text) if "://" not in m}
        for path in cited:
            checked += 1
            if not any((base / path).exists() for base in (REPO, PACKAGE, doc.parent)):
                missing.append(f"{doc.relative_to(REPO)}: {path}")
        missing += [f"{doc.relative_to(REPO)}: {name}" for name in set(_NAME_RE.findall(text)) if name not in names]
    assert checked > 20 and not missing, missing


def test_nothing_cites_a_design_doc_the_repository_does_not_have() -> None:
    if (REPO / "DESIGN.md").exists():
        pytest.skip("the repository has a DESIGN.md")
    hits = [str(p.relative_to(REPO)) for p in [REPO / "README.md", *REPO.glob("docs/*.md"), *PACKAGE.rglob("*.py"),
                                                *REPO.glob("tests/*.py"), *REPO.glob("bench/*.py")]
            if "DESIGN.md" in p.read_text() and p.name != "test_structure.py"]
    assert not hits, hits
