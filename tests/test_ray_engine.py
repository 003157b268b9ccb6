"""engine=ray end to end on a real local Ray cluster (a head node and 1-core training nodes on
this host, `local_cluster/ray_cluster.py`, one cluster for the module): the job's controller actor
places one training actor per node, and the actors train a real YOLO model on generated data.
Scenarios: too few nodes for min_nodes; a node killed mid-epoch (the survivor keeps its process
and re-forms in memory), then a node added to the cluster (placed, pre-warmed, joins at a
commit); a spot notice (the node drains with no step lost); every node lost (a full restart from
S3) and the job to its end; Ray's own preemption drain (slow). Every finished epoch trained each
sample once (the workers' traces).

The whole scenario runs in a network namespace with only `lo` up and no route
(`local_cluster/netns.py`): the Ray nodes, the driver (the test's main thread, moved into it for
the module) and the moto S3 server. Ray's nodes advertise 127.0.0.1 there, and nothing can reach
another address.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("torch")
pytest.importorskip("ray")

from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.engines import ray as ray_jobs  # noqa: E402
from elasticyolo.local_cluster.netns import LoopbackNamespace, unavailable  # noqa: E402
from elasticyolo.local_cluster.ray_cluster import LocalRayCluster  # noqa: E402
from elasticyolo.local_cluster.servers import S3Server  # noqa: E402
from elasticyolo.local_cluster.trace import TraceEvents, coverage_by_epoch, read_trace  # noqa: E402
from elasticyolo.local_cluster.wait import wait_for  # noqa: E402
from elasticyolo.status import render_table  # noqa: E402

pytestmark = pytest.mark.ray_in_process

N_TRAIN = 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=N_TRAIN, val=8, imgsz=64, classes=2))


@pytest.fixture(scope="module")
def loopback_ns() -> Iterator[LoopbackNamespace]:
    """The test process's main thread in a namespace with only `lo`, for the module."""
    reason = unavailable()
    if reason:
        pytest.skip(f"the Ray scenarios run in a network namespace: {reason}")
    with LoopbackNamespace() as ns, ns.entered():
        yield ns


@pytest.fixture(scope="module")
def ray_cluster(loopback_ns: LoopbackNamespace) -> Iterator[LocalRayCluster]:
    cluster = LocalRayCluster()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def ray_s3(loopback_ns: LoopbackNamespace) -> Iterator[S3Server]:
    """moto's S3 server on the namespace's loopback (the session's one is out of reach there)."""
    with S3Server() as server:
        yield server


def spec_pairs(data: Path, epochs: int, **extra: Any) -> list[str]:
    pairs = {"model": "yolov8n.yaml", "data": str(data), "epochs": epochs, "imgsz": 64, "batch": 4, "nbs": 8,
             "warmup_epochs": 0, "close_mosaic": 0, "val": "false", "engine": "ray", "commit_every": 2,
             "resize_warmup_steps": 3, "amp": "false", "workers": 0, "gloo_timeout_s": 30, **extra}
    return [f"{k}={v}" for k, v in pairs.items()]


# Ray's driver resolves a loopback cluster address to the address of the interface with the
# default route; in the test's namespace there is none, and its C++ core logs one warning that it
# falls back to hostname resolution (127.0.0.1) before anything of ours runs. A host with a route
# prints no such line.
RAY_NO_ROUTE_WARNING = re.compile(r"^\[[^\]]* W \d+ \d+\] network_util\.cc:\d+: Failed to determine local IP.*\n",
                                  re.MULTILINE)


def without_ray_route_warning(stderr: str) -> str:
    return RAY_NO_ROUTE_WARNING.sub("", stderr)


class RayJob(TraceEvents):
    """One job on the shared cluster: its submission, its records and its workers' traces."""

    def __init__(self, cluster: LocalRayCluster, tmp: Path, name: str) -> None:
        super().__init__(tmp / "trace")
        self.cluster, self.tmp, self.name = cluster, tmp, name

    def submit(self, pairs: list[str], **kw: Any) -> dict[str, Any]:
        env = {"ELASTICYOLO_TRACE_DIR": str(self.trace_dir), **kw.pop("env", {})}
        return ray_jobs.submit(pairs, self.name, work_root=str(self.tmp / "nodes"),
                               runtime_env={"env_vars": env}, **kw)

    def status(self) -> dict[str, Any]:
        return ray_jobs.status(self.name)

    def wait(self, cond: Any, timeout: float, what: str) -> Any:
        return wait_for(cond, timeout, what, interval=0.2,
                        context=lambda: f"status: {json.dumps(self.status(), default=str)[:3000]}")

    def check_exactly_once(self) -> int:
        cov = coverage_by_epoch(read_trace(self.trace_dir))
        done = [e for e in sorted(cov) if e < max(cov)]
        for epoch in done:
            assert sorted(cov[epoch]) == list(range(N_TRAIN)), f"epoch {epoch}: duplicates or gaps"
        return len(done)


@pytest.fixture
def ray_job(ray_cluster: LocalRayCluster, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RayJob]:
    job = RayJob(ray_cluster, tmp_path, "t-" + request.node.name.replace("_", "-")[:40].lower())
    yield job
    ray_jobs.cancel(job.name)
    ray_cluster.remove_all()


def test_the_cli_refuses_fewer_nodes_with_room_than_min_nodes_in_one_line_without_torch(
        ray_cluster: LocalRayCluster, ray_job: RayJob, dataset: Path) -> None:
    """`elasticyolo ray submit|status --address ...` against the cluster: too few nodes for
    min_nodes is one line and starts nothing; `status --json` of a job never started says none.
    The CLI never imports torch (the training actors do)."""
    import subprocess
    import sys

    ray_cluster.add()

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        code = ("import sys\nfrom elasticyolo.cli import main\nrc = main(%r)\n"
                "assert 'torch' not in sys.modules, 'torch imported'\nsys.exit(rc)") % (list(args),)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)

    got = cli("ray", "submit", "--address", ray_cluster.address, "--job", ray_job.name,
              *spec_pairs(dataset, epochs=1, min_nodes=2))
    ours = without_ray_route_warning(got.stderr)
    assert got.returncode == 2 and ours.count("\n") == 1, got.stderr
    assert "has 1 node(s) with room for 1 slot(s)" in ours and "min_nodes=2" in ours, got.stderr
    got = cli("ray", "status", "--address", ray_cluster.address, "--job", ray_job.name, "--json")
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["state"] == "none"  # nothing was started or written


def test_a_node_killed_mid_epoch_then_a_node_added_joins_at_a_commit(ray_cluster: LocalRayCluster,
                                                                     ray_job: RayJob, dataset: Path) -> None:
    """A node killed mid-epoch (its raylet and every process on it): the survivor keeps its process
    and re-forms in memory at its last commit. Then a node is added to the cluster (`ray start`):
    the controller's pending placement group lands on it, a training actor pre-warms there and
    joins; the running world leaves at a commit, so no step it trained is lost."""
    job = ray_job
    a, b = ray_cluster.add(), ray_cluster.add()
    job.submit(spec_pairs(dataset, epochs=200, min_nodes=1))
    job.wait(lambda: {e["rank"] for e in job.steps_after(0, 2) if e["step"] >= 4} == {0, 1}, 180,
             "both ranks past step 4 at world 2")
    view = job.status()
    assert view["state"] == "running" and view["world_size"] == 2, view
    a_name, b_name = a.node_id[:12], b.node_id[:12]
    assert {n["id"] for n in view["nodes"]} == {a_name, b_name}, view["nodes"]
    assert {n["host"] for n in view["nodes"]} == {"127.0.0.1"}, view["nodes"]
    assert ray_cluster.address.startswith("127.0.0.1:") and ray_cluster.node_addresses() == {"127.0.0.1"}
    a_pid = max(job.worker_pids(a_name))
    table = render_table(view)
    assert "WORLD 2" in table and a_name in table and b_name in table, table

    t_kill = time.time()
    ray_cluster.kill(b.node_id)
    step1 = job.wait(lambda: job.steps_after(t_kill, 1), 60, "a step at world 1")[0]
    resume_a = [e for e in job.events("resume", node=a_name) if e["t"] > t_kill][0]
    assert (resume_a["world"], resume_a["source"], resume_a["pid"]) == (1, "memory", a_pid), resume_a
    last_commit = max(e["step"] for e in job.events("commit", pid=a_pid) if e["t"] < resume_a["t"])
    assert resume_a["step"] == last_commit and step1["step"] == last_commit + 1, (resume_a, last_commit, step1)
    job.wait(lambda: (v := job.status())["world_size"] == 1 and [n["id"] for n in v["nodes"]] == [a_name], 30,
             "status: world 1 on the survivor")

    t_join = time.time()
    c = ray_cluster.add()
    c_name = c.node_id[:12]
    job.wait(lambda: {e["rank"] for e in job.steps_after(t_join, 2)} == {0, 1}, 180, "world 2 with the new node")
    by_node = {e["node"]: e for e in job.events("resume") if e["t"] > t_join}
    assert set(by_node) == {a_name, c_name}, by_node
    assert (by_node[a_name]["pid"], by_node[a_name]["source"]) == (a_pid, "memory"), by_node
    assert by_node[c_name]["source"] == "peer" and by_node[a_name]["step"] == by_node[c_name]["step"], by_node
    assert by_node[a_name]["params_digest"] == by_node[c_name]["params_digest"]
    before = [e["step"] for e in job.events("step", pid=a_pid) if e["t"] < by_node[a_name]["t"]]
    assert by_node[a_name]["step"] == max(before), (by_node[a_name], max(before))  # no step thrown away
    steps_a = sorted(e["t"] for e in job.events("step", pid=a_pid))
    pause = max(t2 - t1 for t1, t2 in zip(steps_a, steps_a[1:]) if t2 > t_join)
    job.wait(lambda: max(e["epoch"] for e in job.events("step")) >= 3, 180, "three epochs done")
    assert job.check_exactly_once() >= 2
    print(f"\nTIMING ray engine kill_to_next_step={step1['t'] - t_kill:.2f}s "
          f"join: longest gap between the survivor's steps {pause:.2f}s")


def test_a_spot_notice_drains_its_node_with_no_step_lost(ray_cluster: LocalRayCluster, ray_job: RayJob,
                                                          dataset: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Submitted with `elasticyolo ray submit --notice-file`: the project's spot watcher runs on
    every node (slot 0's actor); a notice file appears for one node: its actor leaves at the next
    commit, the survivor goes on from that commit in its process, and the node is let go. No step
    is lost (the survivor's resume record says 0)."""
    import subprocess
    import sys

    job = ray_job
    monkeypatch.setenv("ELASTICYOLO_TRACE_DIR", str(job.trace_dir))  # the nodes' processes inherit it
    a, b = ray_cluster.add(), ray_cluster.add()
    notice = tmp_path / "notice-{node}"
    got = subprocess.run([sys.executable, "-m", "elasticyolo.cli", "ray", "submit", "--address", ray_cluster.address,
                          "--job", job.name, "--notice-file", str(notice), "--work-dir", str(tmp_path / "nodes"),
                          *spec_pairs(dataset, epochs=200)], capture_output=True, text=True, timeout=180)
    assert got.returncode == 0 and f"job {job.name} submitted" in got.stdout, got.stderr
    job.wait(lambda: {e["rank"] for e in job.steps_after(0, 2) if e["step"] >= 4} == {0, 1}, 180,
             "both ranks past step 4 at world 2")
    a_name, b_name = a.node_id[:12], b.node_id[:12]
    a_pid = max(job.worker_pids(a_name))

    t_notice = time.time()
    written = tmp_path / "notice.tmp"
    written.write_text(json.dumps({"in_s": 60}))
    written.rename(str(notice).replace("{node}", b_name))
    job.wait(lambda: job.steps_after(t_notice, 1), 60, "a step at world 1")
    resume_a = [e for e in job.events("resume", node=a_name) if e["t"] > t_notice][0]
    assert (resume_a["world"], resume_a["source"], resume_a["pid"]) == (1, "memory", a_pid), resume_a
    before = [e["step"] for e in job.events("step") if e["t"] < resume_a["t"]]
    assert resume_a["step"] == max(before), (resume_a, max(before))  # the world left at its last step
    view = job.wait(lambda: (v := job.status())["nodes"] and len(v["nodes"]) == 1 and v, 30, "the node let go")
    assert view["last_resume"]["lost_steps"] == 0, view["last_resume"]
    kinds = [e["kind"] for e in view["events"]]
    assert kinds[:3] == ["notice", "drain_start", "drain_end"], view["events"]
    assert [e["lost_steps"] for e in view["events"] if e["kind"] == "drain_end"] == [0]
    job.wait(lambda: max(e["epoch"] for e in job.events("step")) >= 2, 180, "two epochs done")
    assert job.check_exactly_once() >= 1
    print(f"\nTIMING ray engine drain: notice -> world 1 step "
          f"{job.steps_after(t_notice, 1)[0]['t'] - t_notice:.2f}s")


def test_every_node_lost_the_job_restarts_from_s3_and_runs_to_the_end(ray_cluster: LocalRayCluster, ray_job: RayJob,
                                                                      dataset: Path, ray_s3: S3Server) -> None:
    """Every training node killed: nothing is left in memory or on a node. The controller (on the
    head node) waits; a new node comes, and its actor restores the newest checkpoint from S3. The
    job then runs to its end: state done, the final checkpoint and rank 0's Ultralytics run
    folder in the store, every epoch trained each sample once across the restart."""
    import boto3

    from elasticyolo.checkpoint import open_store, read_latest
    from elasticyolo.local_cluster.trace import assert_each_epoch_exactly_once

    job = ray_job
    boto3.client("s3", endpoint_url=ray_s3.endpoint_url, **_aws(ray_s3)).create_bucket(Bucket="ray-restart")
    uri = "s3://ray-restart/jobs"
    epochs = 5
    a = ray_cluster.add()
    job.submit(spec_pairs(dataset, epochs=epochs, checkpoint=uri, save_period_steps=3), env=ray_s3.env())
    for k, v in ray_s3.env().items():
        os.environ.setdefault(k, v)
    store = open_store(uri)
    job.wait(lambda: (m := read_latest(store, job.name)) is not None and m.step >= 6, 240,
             "a checkpoint at step >= 6 in S3")
    ray_cluster.kill(a.node_id)
    job.wait(lambda: not job.status()["nodes"], 30, "every node let go")
    saved = read_latest(store, job.name)
    assert saved is not None and saved.reason != "final", saved

    t_new = time.time()
    c = ray_cluster.add()
    resume = job.wait(lambda: [e for e in job.events("resume") if e["t"] > t_new], 180, "training again")[0]
    assert resume["node"] == c.node_id[:12] and resume["source"] == "store", resume
    assert resume["step"] >= saved.step, (resume, saved)

    view = job.wait(lambda: (v := job.status())["state"] == "done" and v, 240, "the job done")
    assert view["epoch"] == epochs and not view["nodes"], view  # the epoch counter after the last one
    final = read_latest(store, job.name)
    assert final is not None and final.reason == "final", final
    run = {o.key for o in store.list(f"{job.name}/run/")}
    assert {f"{job.name}/run/results.csv", f"{job.name}/run/weights/last.pt"} <= run, sorted(run)
    assert_each_epoch_exactly_once(read_trace(job.trace_dir), epochs, N_TRAIN)


def _aws(s3_server: S3Server) -> dict[str, str]:
    env = s3_server.env()
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
            "region_name": env["AWS_DEFAULT_REGION"]}


@pytest.mark.slow
def test_ray_draining_a_node_for_preemption_drains_it_with_no_step_lost(ray_cluster: LocalRayCluster,
                                                                        ray_job: RayJob, dataset: Path) -> None:
    """Ray's own preemption notice (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`, which
    Ray's autoscaler and KubeRay send for a preempted node): the controller reads Ray's drain state
    and drains the node as on a spot notice."""
    import subprocess
    import sys

    job = ray_job
    a, b = ray_cluster.add(), ray_cluster.add()
    job.submit(spec_pairs(dataset, epochs=200))
    job.wait(lambda: {e["rank"] for e in job.steps_after(0, 2) if e["step"] >= 4} == {0, 1}, 180,
             "both ranks past step 4 at world 2")
    a_name = a.node_id[:12]
    a_pid = max(job.worker_pids(a_name))
    t_drain = time.time()
    ray_cli = str(Path(sys.executable).with_name("ray"))
    subprocess.run([ray_cli, "drain-node", "--address", ray_cluster.address, "--node-id", b.node_id,
                    "--reason", "DRAIN_NODE_REASON_PREEMPTION", "--reason-message", "spot preemption",
                    "--deadline-remaining-seconds", "60"], check=True, capture_output=True, timeout=60)
    job.wait(lambda: job.steps_after(t_drain, 1), 60, "a step at world 1")
    resume_a = [e for e in job.events("resume", node=a_name) if e["t"] > t_drain][0]
    assert (resume_a["world"], resume_a["source"], resume_a["pid"]) == (1, "memory", a_pid), resume_a
    view = job.wait(lambda: (v := job.status())["nodes"] and len(v["nodes"]) == 1 and v, 30, "the node let go")
    assert view["last_resume"]["lost_steps"] == 0, view["last_resume"]
    assert [e["provider"] for e in view["events"] if e["kind"] == "notice"] == ["ray"], view["events"]
    assert [e["lost_steps"] for e in view["events"] if e["kind"] == "drain_end"] == [0]


@pytest.mark.slow
def test_a_frozen_node_is_left_out_when_ray_declares_it_dead(ray_cluster: LocalRayCluster, ray_job: RayJob,
                                                             dataset: Path) -> None:
    """A whole node frozen (SIGSTOP of its raylet, its agents and its training actor: nothing is
    closed, no collective fails). Ray's health checks declare it dead; the controller publishes
    the next world with `abort`, and the survivor aborts the collective it is blocked in and
    re-forms in memory, in its process."""
    import os
    import signal

    job = ray_job
    a, b = ray_cluster.add(), ray_cluster.add()
    job.submit(spec_pairs(dataset, epochs=200))
    job.wait(lambda: {e["rank"] for e in job.steps_after(0, 2) if e["step"] >= 4} == {0, 1}, 180,
             "both ranks past step 4 at world 2")
    a_name, b_name = a.node_id[:12], b.node_id[:12]
    a_pid = max(job.worker_pids(a_name))
    frozen = ray_cluster.pids(b.node_id) + sorted(job.worker_pids(b_name))
    t_freeze = time.time()
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    try:
        job.wait(lambda: job.steps_after(t_freeze, 1), 60, "a step at world 1")
        resume_a = [e for e in job.events("resume", node=a_name) if e["t"] > t_freeze][0]
        assert (resume_a["world"], resume_a["source"], resume_a["pid"]) == (1, "memory", a_pid), resume_a
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    print(f"\nTIMING ray engine frozen node -> next step {job.steps_after(t_freeze, 1)[0]['t'] - t_freeze:.2f}s")
