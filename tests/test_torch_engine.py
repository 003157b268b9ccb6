"""engine=torch end to end: real `elasticyolo agent` processes (each one node with one slot); the
survivors of every world change re-form their process group in place (torch's Gloo
reconfiguration) and keep their processes; the workers train a real YOLO model on generated data.
Scenarios: SIGKILL one of two agents mid-epoch, a third node joins, a node frozen then thawed, a
node drained on a spot notice, the job runs to the end with a checkpoint store and a resubmission
resumes from the store, an etcd member dies.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import psutil
import pytest

pytest.importorskip("torch")

from elasticyolo.cluster.etcd import EtcdClient  # noqa: E402
from elasticyolo.cluster.jobs import submit_spec  # noqa: E402
from elasticyolo.cluster.keys import JobKeys  # noqa: E402
from elasticyolo.data.synth import SynthSpec, write_dataset  # noqa: E402
from elasticyolo.local_cluster.agents import ELASTICYOLO, AgentProcess  # noqa: E402
from elasticyolo.local_cluster.trace import TraceEvents, coverage_by_epoch, read_trace  # noqa: E402
from elasticyolo.local_cluster.wait import wait_for  # noqa: E402
from elasticyolo.processes import running  # noqa: E402
from elasticyolo.spec import TrainSpec  # noqa: E402
from elasticyolo.worker_runtime.prewarm import WARMING_EVENT  # noqa: E402

N_TRAIN = 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data"), SynthSpec(train=N_TRAIN, val=8, imgsz=64, classes=2))


def spec_pairs(data: Path, epochs: int, **extra: Any) -> list[str]:
    # batch 4, nbs 8 -> accumulate 2 at world 1, 1 at world 2+ (linear policy); val off for speed.
    pairs = {"model": "yolov8n.yaml", "data": str(data), "epochs": epochs, "imgsz": 64, "batch": 4, "nbs": 8,
             "warmup_epochs": 0, "close_mosaic": 0, "val": "false", "engine": "torch", "commit_every": 2,
             "resize_warmup_steps": 3, "amp": "false", "gloo_timeout_s": 30, **extra}
    return [f"{k}={v}" for k, v in pairs.items()]


class TorchJob(TraceEvents):
    """Agents of one job, the job's etcd records and the workers' traces."""

    def __init__(self, tmp: Path, endpoints: str, job: str, ttl: int = 2) -> None:
        super().__init__(tmp / "trace")
        self.tmp, self.endpoints, self.job, self.ttl = tmp, endpoints, job, ttl
        self.client = EtcdClient(endpoints, retry_window=10)
        self.keys = JobKeys(job)
        self.agents: dict[str, AgentProcess] = {}
        self.env = {"ELASTICYOLO_TRACE_DIR": str(self.trace_dir), "ELASTICYOLO_WORK_DIR": str(tmp / "nodes"),
                    "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}

    def submit(self, pairs: list[str], replace: bool = False) -> None:
        assert submit_spec(self.client, self.keys, TrainSpec.from_pairs(pairs), by="test", replace=replace)

    def start(self, node: str, extra: list[str] | None = None) -> AgentProcess:
        agent = AgentProcess(self.endpoints, self.job, node, ttl=self.ttl, log_dir=self.tmp, env=self.env,
                             extra=list(extra or [])).start()
        self.agents[node] = agent
        return agent

    def state(self) -> str | None:
        got = self.client.get(self.keys.state)
        return json.loads(got[0])["state"] if got else None

    def cancel(self) -> None:
        got = self.client.get(self.keys.state)
        assert got is not None
        ok, _ = self.client.compare_and_swap(self.keys.state, json.dumps({"state": "cancelled", "at": time.time()}),
                                             got[1])
        assert ok

    def logs(self) -> str:
        return "\n".join(f"--- agent {n}\n{a.log_path.read_text(errors='replace')[-5000:]}"
                         for n, a in self.agents.items())

    def wait(self, cond: Any, timeout: float, what: str) -> Any:
        return wait_for(cond, timeout, what, interval=0.1, context=self.logs)

    def stop_all(self) -> None:
        for a in self.agents.values():
            a.stop(timeout=30)


def gone(pid: int) -> bool:
    return not running(pid)


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[Any]:
    made: list[TorchJob] = []

    def make(endpoints: str, job: str, **kw: Any) -> TorchJob:
        j = TorchJob(tmp_path, endpoints, job, **kw)
        made.append(j)
        return j

    yield make
    for j in made:
        j.stop_all()
        pids = {e["pid"] for e in j.events("resume")}
        for pid in pids:  # never leave a worker behind, even when the test failed
            if not gone(pid):
                psutil.Process(pid).kill()
        assert all(wait_for(lambda p=p: gone(p), 10, f"worker {p} gone") for p in pids)


def test_kill_one_of_two_agents_then_a_third_joins(etcd_server, job_name, dataset, jobs) -> None:
    job = jobs(etcd_server.endpoints, job_name)
    # Two prefetching loader processes per worker; channels_last=true: the NHWC layout a GPU trains
    # in (layout.py), through the gradient all-reduce and the joiner's state broadcast.
    job.submit(spec_pairs(dataset, epochs=200, workers=2, channels_last="true"))
    job.start("a")
    b = job.start("b")
    job.wait(lambda: {e["rank"] for e in job.steps_after(0, 2) if e["step"] >= 4} == {0, 1}, 120,
             "both ranks past step 4 at world 2")
    # A may form a world of one before B registers (a loaded host: seen in a clean-clone run); the
    # world of two that follows starts both ranks from the same parameters either way.
    first = [e for e in job.events("resume") if e["world"] == 2]
    assert len(first) == 2 and first[0]["params_digest"] == first[1]["params_digest"], first

    # SIGKILL B's agent mid-epoch: its worker dies with it; A's worker re-forms a world of one in
    # place, rolled back to its last commit in memory.
    b_workers = job.worker_pids("b")
    assert len(job.worker_pids("a")) == 1
    a_worker = max(job.worker_pids("a"))
    t_kill = time.time()
    b.kill()
    job.wait(lambda: all(gone(p) for p in b_workers), 10, "B's worker killed with its agent")
    step1 = job.wait(lambda: job.steps_after(t_kill, 1), 90, "a step at world 1")[0]
    kill_to_step = step1["t"] - t_kill
    resume_a = [e for e in job.events("resume", node="a") if e["t"] > t_kill][0]
    # The commits before that resume (A commits again at world 1 while this test reads the trace).
    last_commit = max(e["step"] for e in job.events("commit", pid=a_worker) if e["t"] < resume_a["t"])
    assert (resume_a["world"], resume_a["source"], resume_a["pid"]) == (1, "memory", a_worker), resume_a
    assert resume_a["step"] == last_commit, (resume_a, last_commit)  # the newest state, not older
    assert step1["step"] == last_commit + 1

    # A third node joins: the world grows to 2; C gets A's state (it has no snapshot of its own).
    t_join = time.time()
    job.start("c")
    job.wait(lambda: {e["rank"] for e in job.steps_after(t_join, 2)} == {0, 1}, 120, "world 2 with C")
    join_to_step = min(e["t"] for e in job.steps_after(t_join, 2)) - t_join
    resumed = [e for e in job.events("resume") if e["t"] > t_join]
    by_node = {e["node"]: e for e in resumed}
    assert set(by_node) == {"a", "c"}, resumed
    assert by_node["c"]["source"] == "peer" and by_node["a"]["source"] == "memory", resumed
    assert by_node["a"]["pid"] == a_worker, "the survivor's worker process was replaced on a join"
    assert by_node["a"]["step"] == by_node["c"]["step"] >= resume_a["step"]
    assert by_node["a"]["params_digest"] == by_node["c"]["params_digest"]
    # A's world of one ended at a commit (engines/torch/worker.py): the world of two resumed from
    # A's last step, and no step A trained was thrown away.
    before = [e["step"] for e in job.events("step", pid=resume_a["pid"]) if e["t"] < by_node["a"]["t"]]
    assert by_node["a"]["step"] == max(before), (by_node["a"], max(before))
    job.wait(lambda: max(e["step"] for e in job.steps_after(t_join, 2)) >= by_node["c"]["step"] + 3, 60,
             "training continues at world 2")

    # Cancel: both agents stop their launchers and every worker exits.
    workers = {e["pid"] for e in job.events("resume")}
    job.cancel()
    job.wait(lambda: all(gone(p) for p in workers), 60, "all workers stopped after cancel")
    # Every worker loaded through two loader processes, and every epoch completed across the kill
    # and the join trained each sample exactly once (counting committed work: the latest
    # execution of each step).
    loaders = job.events("loader")
    assert loaders and all(e["workers"] == 2 for e in loaders), loaders
    # Every worker was a warm one forked from its node's zygote (worker_runtime/zygote.py), not a
    # fresh process started because the zygote failed; one per node: none was restarted.
    warming = [r for a in job.agents.values() for r in a.log_records() if r.get("event") == WARMING_EVENT]
    assert len(warming) == 3 and all(r.get("forked") for r in warming), warming
    # ... and the warm process is the one that trained (handed its slot, not passed over)
    assert workers <= {r["pid"] for r in warming}, (workers, warming)
    # ... and each node's zygote was forked from its launcher: a node imports torch once.
    zygotes = [r for a in job.agents.values() for r in a.log_records() if r.get("event") == "zygote started"]
    assert zygotes and all(r.get("forked_from") for r in zygotes), zygotes
    events = read_trace(job.trace_dir)
    done_epochs = max(e["epoch"] for e in job.events("step"))
    assert done_epochs >= 1, "no epoch completed"
    cov = coverage_by_epoch(events)
    for epoch in range(done_epochs):
        assert sorted(cov[epoch]) == list(range(N_TRAIN)), f"epoch {epoch}: duplicates or gaps"
    print(f"\nTIMING torch engine kill_to_next_step={kill_to_step:.2f}s join_to_next_step={join_to_step:.2f}s")


def test_a_frozen_node_leaves_at_the_heartbeat_timeout_and_rejoins_when_thawed(etcd_server, job_name, dataset,
                                                                             jobs) -> None:
    """A whole node frozen (SIGSTOP of its agent and every process under it: nothing is closed).
    Its lease (10 s) cannot be what decides: the leader publishes it as a suspect at the heartbeat
    timeout (2 s) and the survivor's round restarts without it. Thawed, it was wrongly suspected:
    it rejoins and the world is 2 again; every finished epoch trained each sample once."""
    from elasticyolo.status import collect

    job = jobs(etcd_server.endpoints, job_name, ttl=10)
    job.submit(spec_pairs(dataset, epochs=200))
    job.start("a")
    job.wait(lambda: job.client.get(job.keys.leader), 30, "a leads")  # the frozen node is not the leader
    b = job.start("b")
    job.wait(lambda: {e["rank"] for e in job.steps_after(0, 2) if e["step"] >= 3} == {0, 1}, 120,
             "world 2 training")
    assert b.proc is not None
    frozen = [b.proc.pid] + [p.pid for p in psutil.Process(b.proc.pid).children(recursive=True)]
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    t_freeze = time.time()
    try:
        step1 = job.wait(lambda: job.steps_after(t_freeze, 1), 60, "a step at world 1")[0]
        assert step1["t"] - t_freeze < 10 - 1, "the lease expired first: the heartbeat timeout did not decide"
        assert job.client.get(job.keys.node("b")) is not None  # its lease still holds
        view = collect(job.client, job.keys)
        assert [n["suspect"] for n in view["nodes"] if n["id"] == "b"] == [True], view["nodes"]
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
    t_thaw = time.time()
    job.wait(lambda: {e["rank"] for e in job.steps_after(t_thaw, 2)} == {0, 1}, 120, "the thawed node back")
    assert job.client.get(job.keys.suspect("b")) is None
    workers = {e["pid"] for e in job.events("resume")}
    job.cancel()
    job.wait(lambda: all(gone(p) for p in workers), 60, "workers stopped after cancel")
    # The frozen worker, thawed mid-step, writes that step's record (before its all-reduce, which
    # then fails) after the survivor's world redid the step: chaos/measure.py's committed_records
    # leaves it out (seen in a clean-clone run: it displaced the world-1 step 4 and read as a gap).
    cov = coverage_by_epoch(read_trace(job.trace_dir))
    done = [e for e in sorted(cov) if e < max(cov)]
    assert done, "no epoch finished"
    for epoch in done:
        assert sorted(cov[epoch]) == list(range(N_TRAIN)), f"epoch {epoch}: duplicates or gaps"
    print(f"\nTIMING torch engine frozen node -> next step {step1['t'] - t_freeze:.2f}s")


def test_spot_notice_drains_a_node_and_the_survivor_reforms_without_waiting_for_its_heartbeat(
        etcd_server, job_name, dataset, jobs, md) -> None:
    """A spot notice on one of two nodes. The node's agent stops its launcher; its worker asks to
    leave, the coordinator publishes a world without it, and both ranks leave the world of two at
    the same commit: the survivor's process enters the world of one at once, with no timeout
    waited out. The drain loses nothing: every finished epoch trained each sample once."""
    job = jobs(etcd_server.endpoints, job_name)
    job.submit(spec_pairs(dataset, epochs=200))
    job.start("a")
    job.wait(lambda: job.client.get(job.keys.leader), 30, "a leads")
    b = job.start("b", ["--spot-provider", "aws", "--metadata-url", md.url, "--spot-poll-interval", "0.5",
                        "--drain-margin-s", "2"])
    job.wait(lambda: {e["rank"] for e in job.steps_after(0, 2) if e["step"] >= 3} == {0, 1}, 120,
             "world 2 training")
    t_notice = time.time()
    md.announce("aws", action="terminate", in_s=20)
    job.wait(lambda: b.proc is not None and b.proc.poll() is not None, 30, "the noticed agent to leave")
    t_left = time.time()
    assert b.proc is not None and b.proc.returncode == 0, job.logs()
    step1 = job.wait(lambda: job.steps_after(t_notice, 1), 60, "a step at world 1")[0]
    # Its worker's member record went with it; the survivor's worker is the same process.
    members = [json.loads(v) for _, v, _ in job.client.get_prefix(job.keys.torch) if b'"member"' in v]
    assert not [m for m in members if m.get("node") == "b"], members
    assert step1["t"] - t_left < 5, f"world 1 trained {step1['t'] - t_left:.1f}s after the node left"
    # The world of two stopped at a commit (engines/torch/worker.py): the survivor resumed from the
    # last step it trained; the drain threw no step away.
    resume_a = [e for e in job.events("resume", node="a") if e["t"] > t_notice][0]
    assert resume_a["pid"] in job.worker_pids("a") and len(job.worker_pids("a")) == 1
    before = [e["step"] for e in job.events("step") if e["t"] < resume_a["t"]]
    assert resume_a["step"] == max(before), (resume_a, max(before))
    # b's worker left at that same commit: it says so in its trace, at the step a resumed from
    left_b = [e for e in job.events("left") if e["pid"] in job.worker_pids("b")]
    assert left_b and left_b[-1]["step"] == resume_a["step"], (left_b, resume_a)
    kinds = [json.loads(v).get("kind") for _, v, _ in job.client.get_prefix(job.keys.events)]
    assert "notice" in kinds and "drain_end" in kinds, kinds
    job.wait(lambda: len(job.steps_after(step1["t"], 1)) >= 2 * (N_TRAIN // 4), 120, "two more epochs at world 1")
    workers = {e["pid"] for e in job.events("resume")}
    job.cancel()
    job.wait(lambda: all(gone(p) for p in workers), 60, "workers stopped after cancel")
    cov = coverage_by_epoch(read_trace(job.trace_dir))
    done = [e for e in sorted(cov) if e < max(cov)]
    assert len(done) >= 2, "no epoch finished"
    for epoch in done:
        assert sorted(cov[epoch]) == list(range(N_TRAIN)), f"epoch {epoch}: duplicates or gaps"
    print(f"\nTIMING torch engine notice -> node left {t_left - t_notice:.2f}s -> world 1 step "
          f"{step1['t'] - t_left:.2f}s")


def test_runs_to_the_end_and_resubmission_resumes_from_the_store(etcd_server, job_name, dataset, jobs,
                                                                 tmp_path: Path) -> None:
    from elasticyolo.checkpoint import list_manifests, open_store

    store_uri = f"file://{tmp_path / 'ckpt'}"
    job = jobs(etcd_server.endpoints, job_name)
    job.submit(spec_pairs(dataset, epochs=2, checkpoint=store_uri))
    job.start("a")
    job.wait(lambda: job.state() == "done", 150, "job done")
    final = max(e["step"] for e in job.events("done"))
    manifests = list_manifests(open_store(store_uri), job_name)
    assert manifests and manifests[-1].step == final
    # Ultralytics' run folder, published next to the checkpoints by rank 0.
    run_dir = tmp_path / "ckpt" / job_name / "run"
    assert (run_dir / "results.csv").read_text().splitlines()[0].startswith("epoch,time,train/box_loss,")
    assert len((run_dir / "results.csv").read_text().splitlines()) == 3  # header + 2 epochs
    assert {"args.yaml", "results.png"} <= {p.name for p in run_dir.iterdir()}
    best = tmp_path / "best.pt"
    r = subprocess.run([ELASTICYOLO, "checkpoints", "download", "--best", "--job", job_name, "--store", store_uri,
                        "-o", str(best)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and best.stat().st_size == (run_dir / "weights" / "best.pt").stat().st_size, r.stderr
    assert (run_dir / "timeline.png").stat().st_size > 0  # drawn by rank 0 at the job's end
    # One command copies the whole published folder here, laid out as Ultralytics'.
    r = subprocess.run([ELASTICYOLO, "checkpoints", "download", "--run", "--job", job_name, "--store", store_uri],
                       capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    local = tmp_path / "runs" / "detect" / job_name
    published = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file())
    assert sorted(p.relative_to(local) for p in local.rglob("*") if p.is_file()) == published
    assert Path("weights/best.pt") in published and Path("results.png") in published
    out = tmp_path / "timeline.png"
    r = subprocess.run([ELASTICYOLO, "report", "--job", job_name, "--etcd", etcd_server.endpoints, "--store",
                        store_uri, "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "checkpoint" in r.stdout and "join" in r.stdout and "leader" in r.stdout, r.stdout
    from PIL import Image

    with Image.open(out) as im:
        im.load()
        assert im.size == (1200, 900)

    # A new submission of the same job (one more epoch) gets a new rendezvous and a new local
    # snapshot directory: the newest state is the store's.
    t_resubmit = time.time()
    job.submit(spec_pairs(dataset, epochs=3, checkpoint=store_uri), replace=True)
    job.wait(lambda: job.state() == "done" and job.events("done") and max(
        e["t"] for e in job.events("done")) > t_resubmit, 150, "resubmitted job done")
    resume = [e for e in job.events("resume") if e["t"] > t_resubmit][0]
    assert (resume["source"], resume["step"], resume["epoch"], resume["consumed"]) == ("store", final, 2, 0), resume
    assert all(e["epoch"] == 2 for e in job.events("step") if e["t"] > t_resubmit)
    # The resumed run continues the same results.csv (its rows come from the checkpointed history).
    assert [line.split(",")[0] for line in (run_dir / "results.csv").read_text().splitlines()[1:]] == ["1", "2", "3"]


def test_etcd_member_sigkilled_mid_training(etcd_cluster3, job_name, dataset, jobs) -> None:
    job = jobs(etcd_cluster3.endpoints, job_name, ttl=5)
    job.submit(spec_pairs(dataset, epochs=200))
    job.start("a")
    job.start("b")
    job.wait(lambda: {e["rank"] for e in job.steps_after(0, 2) if e["step"] >= 3} == {0, 1}, 120,
             "world 2 training")
    resumes = len(job.events("resume"))
    t_kill = time.time()
    etcd_cluster3.kill_member(etcd_cluster3.members[0])  # listed first: everyone talks to it
    # Past the 5 s TTL (a failover slower than that would expire the nodes' leases) both ranks
    # still step in the same world.
    job.wait(lambda: {e["rank"] for e in job.steps_after(t_kill + 5, 2)} == {0, 1}, 10,
             "both ranks training after the etcd member died")
    assert len(job.events("resume")) == resumes, f"the world restarted\n{job.logs()}"
    workers = {e["pid"] for e in job.events("resume")}
    job.cancel()
    job.wait(lambda: all(gone(p) for p in workers), 60, "workers stopped after cancel")


def test_status_shows_progress_and_last_checkpoint_of_a_running_torch_job(etcd_server, job_name, dataset, jobs,
                                                                           tmp_path: Path) -> None:
    """Progress and checkpoint publishing are engine-neutral: `status --json` of a torch job."""
    import subprocess

    from elasticyolo.local_cluster.agents import ELASTICYOLO

    def status() -> dict[str, Any]:
        out = subprocess.run([ELASTICYOLO, "status", "--etcd", etcd_server.endpoints, "--job", job_name, "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    job = jobs(etcd_server.endpoints, job_name)
    job.submit(spec_pairs(dataset, epochs=200, checkpoint=f"file://{tmp_path / 'ckpt'}", save_period_steps=2))
    job.start("a", extra=["--price-per-hour", "0.36", "--on-demand-price-per-hour", "1.2"])
    view = job.wait(lambda: (lambda v: v if v["state"] == "running" and (v["step"] or 0) >= 2
                             and (v["last_checkpoint"] or {}).get("step") else None)(status()), 150,
                    "status to show a running torch job with its step and last checkpoint")
    assert view["epoch"] is not None and view["samples_s"] and view["world_size"] == 1
    ck = view["last_checkpoint"]
    assert ck["uri"].startswith(f"file://{tmp_path / 'ckpt'}") and ck["step"] <= view["step"] and ck["size"] > 0
    assert view["last_resume"]["reason"] == "start" and view["last_resume"]["source"] == "fresh"
    # Live cost and goodput of the priced node, once rank 0 has a steady rate (after 10 steps).
    view = job.wait(lambda: (lambda v: v if v["goodput"]["steady_samples_s_per_worker"] else None)(status()), 150,
                    "a steady samples/s in the progress record")
    node = view["nodes"][0]
    started = json.loads(job.client.get(job.keys.node("a"))[0])["started_at"]  # when its lease was granted
    hours = (view["at"] - started) / 3600
    assert node["started_at"] == started and node["spent_usd"] == pytest.approx(0.36 * hours, abs=1e-6)
    assert view["cost"]["spent_usd"] == pytest.approx(0.36 * hours, abs=1e-6)
    assert view["cost"]["savings_usd"] == pytest.approx((1.2 - 0.36) * hours, abs=2e-6)
    g = view["goodput"]
    assert g["paid_slots"] == 1 and g["ratio"] == pytest.approx(g["samples_s"] / g["steady_samples_s_per_worker"],
                                                                abs=1e-6)
    assert 0 < g["ratio"] <= 1.001  # the steady rate is the best seen so far, this one included
    workers = {e["pid"] for e in job.events("resume")}
    job.cancel()
    job.wait(lambda: all(gone(p) for p in workers), 60, "workers stopped after cancel")
