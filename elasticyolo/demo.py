"""The end-to-end local demo (`make demo` / `elasticyolo demo`): the whole mission offline, in a few
minutes on 2 cores, every server on 127.0.0.1 (docs/demo.md).

The cloud, emulated locally: an embedded etcd; an S3 API server (moto) holding the job's
checkpoints and run folder; per node a metadata server speaking AWS IMDSv2 (its own "VM"). Each
node's agent learns its instance type from its metadata, prices itself from the example price
table (deploy/prices.example.yaml) and watches its metadata for spot notices, as on EC2.

The story: 3 spot nodes train a tiny Horovod job on generated data, checkpointing to S3; n3 gets a
2-minute spot notice and drains (lost steps from its drain report); a replacement node n4 joins;
n2 is SIGKILLed, as a VM lost without a notice is; the job ends. Then `status` shows the cost and
the savings, and the job's run folder is downloaded from the store into `runs/detect/demo`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from elasticyolo.cost import load_price_table
from elasticyolo.data.synth import SynthSpec, write_dataset
from elasticyolo.errors import UserError
from elasticyolo.local_cluster.agent_cluster import AgentCluster
from elasticyolo.local_cluster.agents import ELASTICYOLO
from elasticyolo.local_cluster.metadata_server import MetadataServer
from elasticyolo.local_cluster.servers import EtcdCluster, S3Server, etcd_binary, moto_server
from elasticyolo.local_cluster.wait import wait_for

T = TypeVar("T")

JOB = "demo"
BUCKET = "elasticyolo-demo"
STORE = f"s3://{BUCKET}/jobs"
PRICE_TABLE = Path(__file__).resolve().parents[1] / "deploy" / "prices.example.yaml"
RUN_PROJECT, RUN_NAME = Path("runs/detect"), "demo"
# What AWS gives a spot VM between the notice and the end.
NOTICE_S = 120.0
# What the run folder holds at the end (checked once it is downloaded).
RUN_FILES = ("results.csv", "results.png", "weights/best.pt", "weights/last.pt", "timeline.png")
# The story (a checkpoint, the notice, the join, an epoch at world 3, the kill) takes about 8
# epochs of the 16 by default; fewer than this and the job may end before it is told.
MIN_EPOCHS = 12


def say(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def show(label: str, text: str) -> None:
    print(f"  {label:<14}{text}", flush=True)


def download_run_folder(store_uri: str, job: str, project: Path, name: str) -> Path:
    """The job's run folder (`<store>/<job>/run/`) downloaded into a new `project/name` (`name-2`,
    ... when it exists, as Ultralytics numbers runs), by `checkpoints download --run`'s code."""
    from elasticyolo.checkpoint.run_download import download_run
    from elasticyolo.checkpoint.stores import open_store
    from elasticyolo.run_layout import increment_path

    return download_run(open_store(store_uri, retries=3), job, increment_path(Path(project) / name)).dest


class DemoNodes:
    """The demo's agents, each with a metadata server of its own (its "VM"): the agent reads its
    instance type there and polls it for spot notices every second."""

    def __init__(self, cluster: AgentCluster) -> None:
        self.cluster = cluster
        self.metadata: dict[str, MetadataServer] = {}

    def start(self, node: str) -> None:
        md = self.metadata[node] = MetadataServer(providers=("aws",)).start()
        self.cluster.start(node, "--spot-provider", "aws", "--metadata-url", md.url, "--spot-poll-interval", "1",
                           "--price-table", str(PRICE_TABLE))

    def notice(self, node: str) -> None:
        """The cloud reclaims `node`: AWS's instance-action, `NOTICE_S` ahead."""
        self.metadata[node].announce("aws", action="terminate", in_s=NOTICE_S)

    def stop(self) -> None:
        try:
            self.cluster.stop()
        finally:
            for md in self.metadata.values():
                md.stop()


def _until(c: AgentCluster, condition: Callable[[], T], timeout: float, what: str) -> T:
    """`wait_for`, giving up at once when the job has failed (its nodes' logs say why)."""
    return wait_for(condition, timeout, what, interval=0.1,
                    abort=lambda: "the job failed" if c.job_state() == "failed" else None)


def _status(c: AgentCluster) -> None:
    print(c.status(as_json=False), flush=True)


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _cli(*args: str) -> str:
    """An `elasticyolo` command as a user runs it; its output."""
    r = subprocess.run([ELASTICYOLO, *args], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError(f"elasticyolo {args[0]} failed: {r.stderr.strip()}")
    return r.stdout.rstrip()


def _usd(v: float | None) -> str:
    return "-" if v is None else f"${v:.4f}"


def run_demo(epochs: int = 16, keep: bool = False, workdir: Path | None = None,
             project: Path = RUN_PROJECT, name: str = RUN_NAME) -> int:
    if epochs < MIN_EPOCHS:
        raise UserError(f"--epochs {epochs}: the demo needs at least {MIN_EPOCHS} (its story takes about 8)")
    # What the demo needs beyond the package, each a one-line error when missing.
    moto_server()
    etcd_binary()
    load_price_table(PRICE_TABLE)
    root = Path(workdir or tempfile.mkdtemp(prefix="elasticyolo-demo-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    ok = False
    try:
        say(f"generating a tiny detection dataset under {root}")
        data = write_dataset(root / "data", SynthSpec(train=48, val=16, imgsz=128, classes=3))
        with contextlib.ExitStack() as stack:
            etcd = stack.enter_context(EtcdCluster(size=1))
            s3 = stack.enter_context(S3Server())
            # This process, its commands and the agents use the local S3 server as their AWS.
            stack.enter_context(_environ(s3.env()))
            import boto3

            boto3.client("s3").create_bucket(Bucket=BUCKET)
            c = AgentCluster(etcd.endpoints, JOB, root, env={"OMP_NUM_THREADS": "1"})
            nodes = DemoNodes(c)
            stack.callback(nodes.stop)
            say(f"etcd on {etcd.endpoints}, an S3 API server on {s3.endpoint_url} (bucket {BUCKET})")
            say("starting spot nodes n1 n2 n3, each with a cloud metadata server of its own")
            for n in ("n1", "n2", "n3"):
                nodes.start(n)
            _until(c, lambda: c.ready(["n1", "n2", "n3"]) and c.leader(), 60, "three agents and a leader")
            rec = c.nodes()["n1"]
            show("n1 prices", f"{rec.get('instance_type')} (from its metadata) at ${rec.get('price_per_hour')}/h spot, "
                              f"${rec.get('on_demand_per_hour')}/h on demand ({PRICE_TABLE.name})")
            say(f"leader: {c.leader()}; submitting the job (engine=torch, the default; checkpoint={STORE})")
            # Every rank validates its shard together at epoch ends and joiners are pre-warmed, so a
            # short Gloo timeout is safe; it bounds how long survivors wait on a dead peer.
            # Mosaic off: at 128 px it shrinks objects below what a few dozen steps can learn.
            # LR and global batch (2 x 3 = 6) tuned for 3 workers (ref_world=3); the linear policy
            # rescales the LR at 2. About 180 optimizer steps: enough for mAP50 > 0.9 here.
            # checkpoint_nice=0: the 2 cores are all training's, and an upload at idle priority
            # could wait for the job's end.
            c.submit("model=yolov8n.yaml", f"data={data}", f"epochs={epochs}", "imgsz=128", "batch=2", "nbs=6",
                     "ref_world=3", "warmup_epochs=1", f"close_mosaic={epochs}", "val=true", "min_nodes=2",
                     "gloo_timeout_s=10", "cooldown_s=1,4", f"checkpoint={STORE}", "checkpoint_nice=0")
            _until(c, lambda: c.progress().get("world_size") == 3, 300, "training at world size 3")
            ckpt = _until(c, lambda: c.status()["last_checkpoint"], 120, "a first checkpoint in S3")
            say("a checkpoint landed in S3; status while training with 3 nodes")
            _status(c)

            # A spot notice, as EC2 sends it: the node's metadata starts answering instance-action.
            victim = next(n for n in ("n3", "n2", "n1") if n != c.leader())
            _until(c, lambda: (c.progress().get("consumed") or 0) > 0, 120, "the middle of an epoch")
            say(f"the cloud reclaims {victim}: a spot notice ({NOTICE_S:.0f}s) on its metadata server")
            nodes.notice(victim)
            drained = _until(c, lambda: c.job_events("drain_end"), 60, f"{victim} to drain")[0]
            _until(c, lambda: c.agents[victim].proc.poll() is not None, 30, f"{victim}'s agent to leave")
            lost = drained.get("lost_steps")
            show("drained", f"{victim} {drained.get('notice_to_drained_s')}s after the notice "
                            f"(mode {drained.get('mode')}): {lost} lost steps")
            _until(c, lambda: c.status()["world_size"] == 2, 60, "status to show world 2")
            say("status after the drain")
            _status(c)

            say("a replacement spot node n4 starts (it joins once its worker is pre-warmed)")
            t_join = time.time()
            nodes.start("n4")
            _until(c, lambda: [e for e in c.steps(world=3) if e["t"] > t_join], 300, "training at world size 3 again")
            show("joined", f"n4 trains {time.time() - t_join:.0f}s after its agent started")

            # An epoch at world 3 (8 steps), so the timeline shows the join before the next change.
            _until(c, lambda: len(c.rank0_steps_after(t_join, 3)) >= 8, 120, "an epoch at world size 3")
            crashed = next(n for n, a in c.agents.items()
                           if n != c.leader() and a.proc is not None and a.proc.poll() is None)
            _until(c, lambda: (c.progress().get("consumed") or 0) > 0, 120, "the middle of an epoch")
            say(f"SIGKILL {crashed}'s agent mid-epoch: a VM lost without a notice (its worker dies with it)")
            t_kill = time.time()
            c.kill(crashed)
            _until(c, lambda: [e for e in c.steps(world=2) if e["t"] > t_kill], 120, "training at world size 2")
            first = min(e["t"] for e in c.steps(world=2) if e["t"] > t_kill)
            show("recovered", f"first step of the 2-node world {first - t_kill:.1f}s after the kill")

            c.wait(lambda: c.job_state() in ("done", "failed"), 900, "the job to finish")
            state = c.job_state()
            metrics = c.progress().get("metrics") or {}
            c.wait(lambda: c.job_events("cost"), 30, "the leader's cost summary")
            say(f"job {state} in {time.monotonic() - t0:.0f}s")
            _status(c)
            view = c.status()
            say(f"checkpoints in S3: elasticyolo checkpoints list --job {JOB} --store {STORE}")
            print(_cli("checkpoints", "list", "--job", JOB, "--store", STORE), flush=True)
            run_dir = download_run_folder(STORE, JOB, project, name)

        cost = view.get("cost") or {}
        spent, on_demand, saved = cost.get("spent_usd"), cost.get("on_demand_usd"), cost.get("savings_usd")
        share = f" ({saved / on_demand:.0%})" if saved is not None and on_demand else ""
        say("summary")
        show("checkpoint", f"{ckpt.get('uri')} (the first; the newest at step {view['last_checkpoint'].get('step')})")
        show("spot drain", f"{victim} drained {drained.get('notice_to_drained_s')}s after its notice, "
                           f"{lost} lost steps")
        show("cost", f"{_usd(spent)} spent on spot, {_usd(on_demand)} on demand: saved {_usd(saved)}{share}")
        show("accuracy", f"mAP50 {metrics.get('mAP50', float('nan')):.3f}  "
                         f"mAP50-95 {metrics.get('mAP50-95', float('nan')):.3f}")
        missing = [f for f in RUN_FILES if not (run_dir / f).is_file()]
        show("run folder", f"{run_dir}/ ({', '.join(f for f in RUN_FILES if f not in missing)})"
                           + (f"; missing {', '.join(missing)}" if missing else ""))
        ok = state == "done" and lost == 0 and saved is not None and not missing
        return 0 if ok else 1
    finally:
        if keep or not ok:
            print(f"\nwork dir (agent logs, worker traces) kept: {root}", flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
