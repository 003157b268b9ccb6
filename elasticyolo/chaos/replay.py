"""`elasticyolo chaos replay`: both systems on one window of a trace, measured, projected, written.

Order of work: parse and check everything first (one-line errors before any server starts), then
etcd + S3, the data set, the elasticyolo run (with the ideal's calibration), the checkpoint-restart
run, and last the figures, the projection, the JSON and the plot.
"""

from __future__ import annotations

import contextlib
import json
import math
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from elasticyolo.chaos.measure import measure, pool, stretch_rates
from elasticyolo.chaos.projection import EventCost, project
from elasticyolo.chaos.schedule import Plan, ReplayTimeline, plan_checkpoint_restart, plan_elastic, timeline
from elasticyolo.chaos.trace import SpotTrace, TraceError, check_window, load_trace
from elasticyolo.engines.names import DEFAULT as DEFAULT_ENGINE, check_engine_name
from elasticyolo.errors import UserError

BASELINE = "checkpoint-restart"
VAL_IMAGES = 256  # the accuracy check's validation set (64 gives fewer boxes, more sampling noise in each mAP)


def calibration_span_s(calibrate_s: float, checkpoint_s: float) -> float:
    """A calibration span holds whole checkpoint intervals: with 8 s spans and a checkpoint every
    5 s, a span held one checkpoint or two, and its rate moved by a quarter with that alone
    (world 3 measured at 31, 31 and 66 samples/s on a 2-core host)."""
    return math.ceil(calibrate_s / checkpoint_s - 1e-9) * checkpoint_s if checkpoint_s > 0 else calibrate_s


def first_world(events: list[dict[str, Any]], plan: Plan) -> int:
    """The world size the elastic job trained its first step at (the calibration starts with one
    node): the accuracy check's uninterrupted run trains at it. The first steps of a run from a
    random initialization are chaotic (two runs whose gradients differ in float summation order
    only, world 1 against world 3, were 6e-4 apart after 3 steps and 0.77 of the update after 11),
    so only a reference that shares them compares what the interruptions did; the elastic job's
    epochs at its first world size are bitwise those of the uninterrupted run."""
    steps = [e for e in events if e.get("ev") == "step" and e.get("world")]
    return int(min(steps, key=lambda e: e["t"])["world"]) if steps else len(plan.initial_nodes)


class ReplayFailed(UserError):
    """The cluster did not do what the replay needs (a world never formed, no steps to measure)."""

    exit_code = 1


@dataclass
class ReplayOptions:
    trace: Path
    nodes: int
    compress: float
    start_hour: float
    hours: float
    json_out: Path
    plot_out: Path | None = None
    engine: str = DEFAULT_ENGINE
    baseline: str | None = BASELINE
    notice_s: float | None = None  # default 120 / compress
    notice_fraction: float = 1.0
    seed: int = 0
    model: str = "yolov8n.yaml"
    imgsz: int = 64
    batch: int = 4
    train_images: int = 512
    checkpoint_s: float = 300.0  # trace seconds between periodic checkpoints
    calibrate_s: float = 8.0
    spec: list[str] = field(default_factory=list)  # extra key=value training options
    workdir: Path | None = None
    keep: bool = False
    accuracy: bool = True  # compare the final mAP with an uninterrupted run (chaos/accuracy.py)
    cpus_per_node: float | None = None  # each node's accelerator's CPU quota; None: the host's split evenly, 0: none
    repeats: int = 1  # replays of the window per system (`measure.pool`)


@dataclass(frozen=True)
class Prepared:
    trace: SpotTrace
    timeline: ReplayTimeline
    elastic: Plan
    restart: Plan | None
    notice_s: float


def prepare(o: ReplayOptions) -> Prepared:
    """Everything that can be wrong with the input, checked before anything starts."""
    if o.baseline not in (None, BASELINE):
        raise TraceError(f"--baseline {o.baseline!r}: only {BASELINE!r} is available")
    try:
        check_engine_name(o.engine)
    except ValueError as exc:
        raise TraceError(f"--engine {o.engine!r}: {exc}") from None
    if o.engine == "ray":
        from elasticyolo.engines.installed import engine_refusal
        from elasticyolo.engines.ray.engine import ENGINE
        from elasticyolo.local_cluster.netns import unavailable

        if (refused := engine_refusal(ENGINE)) is not None:
            raise TraceError(f"--engine ray: {refused}")
        if (why := unavailable()) is not None:
            raise TraceError(f"--engine ray: the replay's Ray cluster runs in a network namespace, and {why}")
    if o.repeats < 1:
        raise TraceError(f"--repeats {o.repeats}: must be >= 1")
    if o.cpus_per_node is not None and not (o.cpus_per_node >= 0 and math.isfinite(o.cpus_per_node)):
        raise TraceError(f"--cpus-per-node {o.cpus_per_node:g}: a CPU count >= 0")
    if o.cpus_per_node:
        from elasticyolo.local_cluster.cpu_slices import cgroup_root

        if cgroup_root() is None:
            raise TraceError(f"--cpus-per-node {o.cpus_per_node:g}: no writable cgroup CPU controller on this host")
    trace = load_trace(o.trace)
    window = check_window(trace, o.start_hour, o.hours)
    tl = timeline(trace, window, o.nodes, o.compress)
    notice_s = 120.0 / o.compress if o.notice_s is None else o.notice_s
    elastic = plan_elastic(tl, notice_s=notice_s, notice_fraction=o.notice_fraction, seed=o.seed)
    restart = plan_checkpoint_restart(tl) if o.baseline else None
    return Prepared(trace, tl, elastic, restart, notice_s)


def change_kinds(plan: Plan, tl: ReplayTimeline) -> tuple[list[str], list[float]]:
    """Per change: join | kill_notice | kill_no_notice | restart, and the delay until its node dies."""
    kinds, delays = [], []
    for i, c in enumerate(tl.changes):
        acts = [a for a in plan.actions if a.change == i]
        if any(a.kind == "restart" for a in acts):
            kinds.append("restart")
            delays.append(0.0)
        elif c.after > c.before:
            kinds.append("join")
            delays.append(0.0)
        else:
            noticed = {n for a in acts if a.kind == "notice" for n in a.nodes}
            killed = {n for a in acts if a.kind == "kill" for n in a.nodes}
            kinds.append("kill_notice" if killed <= noticed else "kill_no_notice")
            delays.append(max((a.t - c.t for a in acts if a.kind == "kill"), default=0.0))
    return kinds, delays


def measured_costs(fig: Any, kinds: list[str], rates: dict[int, float], fraction: float) -> dict[str, EventCost]:
    """Mean pause and lost work (seconds of the old world's work) per event type of a live run."""
    out: dict[str, EventCost] = {}
    for kind in ("join", "kill_notice", "kill_no_notice"):
        cs = [c for c, k in zip(fig.changes, kinds) if k == kind]
        if cs:
            pause = sum(c.pause_s for c in cs) / len(cs)
            lost = sum(c.lost_samples / rates[c.before] for c in cs) / len(cs)
            ready = [c.first_step_s for c in cs if c.first_step_s is not None]
            out[kind] = EventCost(pause, lost, f"live elasticyolo replay, mean of {len(cs)} event(s)",
                                  sum(ready) / len(ready) if ready else 0.0)
    kills = [k for k in ("kill_notice", "kill_no_notice") if k in out]
    for kind in ("kill_notice", "kill_no_notice"):
        if kind not in out:
            # Not seen live (e.g. every kill had a notice): its weight in the projection is
            # `fraction` or 1 - fraction; fall back on the other kill type and say so.
            src = out[kills[0]] if kills else EventCost(0.0, 0.0, "")
            out[kind] = EventCost(src.pause_s, src.lost_work_s,
                                  f"not observed live (notice fraction {fraction:g}); "
                                  + (f"{kills[0]}'s figure used" if kills else "no kill observed, 0 used"))
    if "join" not in out:
        out["join"] = EventCost(0.0, 0.0, "not observed live; 0 used")
    return out


def job_spec(o: ReplayOptions, data: Path) -> list[str]:
    """The replayed job's training options."""
    # Epoch-end checkpoints come on top of the periodic ones; few steps per epoch would hand the
    # baseline extra checkpoints, hence the default of 512 images.
    ckpt_live_s = o.checkpoint_s / o.compress
    # One global batch at every world size 1..K (accumulation follows the world): an optimizer step
    # is the same whatever the trace does, so the accuracy check's two runs, at the same epoch,
    # have taken the same steps.
    # And cache=ram: every augmentation draw then depends on (epoch, sample) only (mosaic draws
    # its partners from the whole dataset, not from a buffer of what this process loaded last),
    # so both runs train on the same augmented samples (train/loader_worker.py). And SGD: with
    # the same samples, runs at different world sizes then differ by float summation order only
    # (4.6e-4 of the update after 3 steps at world 3 vs 1), whereas MuSGD, which optimizer=auto
    # picks for a long run, orthogonalizes each update and so lifts that noise to the size of the
    # signal (7e-2 after 3 steps): two MuSGD runs with different world histories part like two
    # seeds, and on a recipe this short that alone moved mAP50-95 by 0.3. And mosaic off: at 64 px
    # it shrinks the objects so far that a few hundred steps learn them or not by chance (0.04 to
    # 0.68 mAP50-95 for runs 5 % of their parameters apart), so no comparison could be decided.
    # And checkpoint_nice=0: the uploads land at the interval. At the default (idle CPU time only)
    # a node that training keeps busy, as every replay node is, uploaded almost nothing, and each of
    # the baseline's restarts went back to a checkpoint from before the window (committed 0 of
    # 1664 samples in one run): a loss the interval does not explain. Both systems, and the
    # calibration, pay the uploads' CPU alike.
    nbs = o.batch * math.lcm(*range(1, o.nodes + 1))
    spec = [f"model={o.model}", f"data={data}", "epochs=100000", f"imgsz={o.imgsz}", f"batch={o.batch}",
            f"nbs={nbs}", "policy=constant_global_batch", "warmup_epochs=0", "close_mosaic=0", "val=false",
            "amp=false", "workers=0", "cache=ram", "optimizer=SGD", "mosaic=0",
            f"engine={o.engine}", "min_nodes=1", "gloo_timeout_s=5", "cooldown_s=1,4",
            "save_period_steps=0", f"save_period_s={ckpt_live_s:g}", "keep_epochs=true", "checkpoint_nice=0",
            *o.spec]
    return spec


def final_world(tl: ReplayTimeline) -> int:
    return tl.changes[-1].after if tl.changes else tl.initial


@contextlib.contextmanager
def replay_services(o: ReplayOptions, spec: list[str], root: Path, notice_s: float,
                    say: Callable[[str], None]) -> Iterator[Any]:
    """The cloud the replayed nodes run in: each node's accelerator slice, etcd, an S3 server with
    the replay's bucket, and for engine=ray a local Ray cluster; yields the runner's `ReplayEnv`.

    A Ray cluster's nodes advertise the address of the host's default route, so for engine=ray
    everything (this process's main thread first, then every server and node it starts) runs in a
    network namespace with only `lo` (`local_cluster/netns.py`)."""
    import boto3

    from elasticyolo.chaos.nodes import ReplayEnv
    from elasticyolo.local_cluster.servers import EtcdCluster, S3Server

    with contextlib.ExitStack() as stack:
        on_ray = o.engine == "ray"
        if on_ray:
            from elasticyolo.local_cluster.netns import LoopbackNamespace

            stack.enter_context(stack.enter_context(LoopbackNamespace()).entered())
        slices = stack.enter_context(cpu_slices(o, say))
        if slices:
            slices.serve_here()  # etcd, the S3 server, the metadata servers, Ray's head node: the cloud's
        etcd = stack.enter_context(EtcdCluster(size=1))
        s3 = stack.enter_context(S3Server())
        bucket = "elasticyolo-replay"
        boto3.client("s3", endpoint_url=s3.endpoint_url, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=bucket)
        env = ReplayEnv(etcd.endpoints, s3.env(), spec, bucket, root, notice_s, say, slices=slices)
        if on_ray:
            env.nodes = stack.enter_context(ray_nodes(say))
        yield env


@contextlib.contextmanager
def ray_nodes(say: Callable[[str], None]) -> Iterator[Callable[..., Any]]:
    """A local Ray cluster for the replay (its health checks tolerant of a busy host: a node is
    lost by its kill, not by a starved raylet); yields the runner's factory of a job's nodes."""
    import functools

    from elasticyolo.chaos.ray_nodes import RayNodes
    from elasticyolo.local_cluster.ray_cluster import TOLERANT_HEALTH_CHECK, LocalRayCluster

    say("engine ray: a local Ray cluster (a head node, then one Ray node per replayed node)")
    cluster = LocalRayCluster(health_check=TOLERANT_HEALTH_CHECK)
    try:
        yield functools.partial(RayNodes, cluster=cluster)
    finally:
        cluster.shutdown()


def ideal_json(run: Any) -> dict[str, Any]:
    """The ideal's rates per world size (a `SystemRun`'s calibrations) and every span measured."""
    return {"ideal_samples_per_s": {str(n): round(r, 2) for n, r in sorted(run.rates.items())},
            "calibration_spans_samples_per_s": {
                when: {str(n): [round(r, 2) for r in rs] for n, rs in sorted(spans.items())}
                for when, spans in (("before", run.span_rates), ("after", run.span_rates_after))}}


def write_json(path: Path, out: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))


@contextlib.contextmanager
def live_run(what: str, o: ReplayOptions, out: dict[str, Any], root: Path, t_begin: float,
             dead: Callable[[dict[str, Any], str], None], say: Callable[[str], None]) -> Iterator[None]:
    """The live part of a replay or a sweep. A job that dies scores nothing: `dead` sets its zeros
    (never a figure from the part before it died), the JSON says `"failed": true` with the reason,
    and the run ends with a one-line error. Any other failure (a world that never formed) ends it
    the same way. The work dir is kept after a failure (logs, traces), else removed unless `keep`."""
    from elasticyolo.chaos.nodes import JobFailed

    failed = False
    try:
        yield
    except JobFailed as exc:
        failed = True
        died = str(exc).splitlines()[0]
        out.update(failed=True, reason=died, wall_s=round(time.monotonic() - t_begin, 1))
        dead(out, died)
        write_json(o.json_out, out)
        raise ReplayFailed(f"{what} failed: {died} (JSON with \"failed\": true written to {o.json_out}; "
                           f"agent logs and worker traces kept under {root})") from None
    except (AssertionError, RuntimeError) as exc:
        failed = True
        raise ReplayFailed(f"{what} failed: {str(exc).splitlines()[0]} "
                           f"(agent logs and worker traces kept under {root})") from None
    finally:
        if not failed and not o.keep:
            import shutil

            shutil.rmtree(root, ignore_errors=True)
        elif not failed:
            say(f"work dir kept: {root}")


def cpu_slices(o: ReplayOptions, say: Callable[[str], None]) -> contextlib.AbstractContextManager[Any]:
    """Each simulated node's accelerator, a CPU quota for its training, beside its host (testing/
    cpu_slices.py): without them, the nodes share the host's cores, and neither the ideal nor a
    join's cost is what separate machines would show."""
    from elasticyolo.local_cluster.cpu_slices import CpuSlices, cgroup_root, default_cpus_per_node

    if o.cpus_per_node == 0:
        say("nodes share the host's CPUs (--cpus-per-node 0)")
        return contextlib.nullcontext()
    if cgroup_root() is None:  # (an explicit quota was checked by prepare())
        say("no writable cgroup CPU controller here: the nodes share the host's CPUs")
        return contextlib.nullcontext()
    cpus = o.cpus_per_node or default_cpus_per_node(o.nodes)
    say(f"each node trains on an accelerator of {cpus:.3g} CPUs (a CFS quota of its own); "
        "everything else the node runs (its agent or Ray's daemons, its standby) runs on its host beside it")
    return CpuSlices(cpus, nodes=o.nodes)


def run_replay(o: ReplayOptions, say: Callable[[str], None] = print, argv: list[str] | None = None) -> dict[str, Any]:
    prep = prepare(o)
    tl = prep.timeline
    say(f"trace {o.trace}: window hours {o.start_hour:g}-{o.start_hour + o.hours:g}, {o.nodes} nodes "
        f"(count x {o.nodes}/{prep.trace.max_count}), compressed {o.compress:g}x -> {tl.duration_s:.0f}s, "
        f"{len(tl.changes)} changes, initial world {tl.initial}")
    for t, node, noticed in prep.elastic.victims():
        say(f"  victim (seed {o.seed}): {node} at t={t:.1f}s " + (f"after a {prep.notice_s:g}s notice" if noticed
                                                                   else "by SIGKILL, no notice"))
    # Heavy imports only now (the CLI stays quick for bad input).
    from elasticyolo.chaos.runner import SHARED_STEPS, Episode, run_checkpoint_restart, run_elastic
    from elasticyolo.data.synth import SynthSpec, write_dataset

    root = Path(o.workdir or tempfile.mkdtemp(prefix="elasticyolo-replay-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    data = write_dataset(root / "data", SynthSpec(train=o.train_images, val=VAL_IMAGES, imgsz=o.imgsz, classes=2))
    spec = job_spec(o, data)
    ckpt_live_s = o.checkpoint_s / o.compress
    out: dict[str, Any] = {
        "command": "elasticyolo " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "trace": str(o.trace), "window": {"start_hour": o.start_hour, "hours": o.hours,
                                          "name": f"hours {o.start_hour:g}-{o.start_hour + o.hours:g}"},
        "nodes": o.nodes, "compress": o.compress, "engine": o.engine, "notice_s": prep.notice_s,
        "notice_fraction": o.notice_fraction, "seed": o.seed, "repeats": o.repeats,
        "replay_s": tl.duration_s,
        "checkpoint_interval_s": {"live": ckpt_live_s, "trace": o.checkpoint_s},
        "changes": [{"t": round(c.t, 2), "trace_hour": round(c.trace_t / 3600, 4), "before": c.before,
                     "after": c.after} for c in tl.changes],
        "victims": [{"t": round(t, 2), "node": n, "notice": nz} for t, n, nz in prep.elastic.victims()],
        "spec": spec,
    }
    t_begin = time.monotonic()

    def dead(out: dict[str, Any], reason: str) -> None:
        out["systems"] = {"elasticyolo": {"failed": True, "reason": reason, "goodput_vs_ideal": 0.0,
                                          "committed_samples": 0}}

    with live_run("replay", o, out, root, t_begin, dead, say):
        with replay_services(o, spec, root, prep.notice_s, say) as env:
            out["cpus_per_node"] = round(env.slices.cpus, 3) if env.slices else None
            say("elasticyolo: calibrating steady-state samples/s per node count, then replaying")
            episode = Episode(prep.elastic, tl.duration_s, final_world(tl))
            er = run_elastic(env, [episode] * o.repeats, o.nodes, calibration_span_s(o.calibrate_s, ckpt_live_s),
                             shared_steps=SHARED_STEPS if o.accuracy else 0)
            runs = [er]
            if prep.restart is not None:
                say("checkpoint-restart: replaying the same window, stop-the-world at every change")
                runs.append(run_checkpoint_restart(env, prep.restart, tl.duration_s, o.nodes, final_world(tl),
                                                   repeats=o.repeats))
            if o.accuracy:
                from elasticyolo.chaos.accuracy import check_accuracy

                out["accuracy"] = check_accuracy(env, data, o.imgsz, first_world(er.events, prep.elastic),
                                                 o.nodes, timeout_s=max(600.0, 5 * tl.duration_s))
    out["wall_s"] = round(time.monotonic() - t_begin, 1)
    # The ideal: the calibrations' median steady rates, before and after the replay (chaos/
    # runner.py). The replays' own steady stretches are reported beside them as a check (the load
    # can differ between the runs), not mixed in: raising the ideal to the best stretch seen made
    # it the luckiest noise on the box.
    rates = dict(er.rates)
    out.update(ideal_json(er))
    out["steady_stretch_samples_per_s"] = {
        run.name: {str(n): round(r, 2) for n, r in sorted(stretch_rates(
            run.events, run.windows[0].t_start, run.windows[-1].t_stop).items())}
        for run in runs}
    systems: dict[str, Any] = {}
    figs = {}
    for run, plan in zip(runs, [prep.elastic, prep.restart]):
        assert plan is not None
        kinds, delays = change_kinds(plan, tl)
        fig = pool([measure(run.events, t_start=w.t_start, tl=tl, rates=rates, num_samples=o.train_images,
                            change_kinds=kinds, change_delays=delays, until=w.t_stop) for w in run.windows])
        kinds = kinds * len(run.windows)  # one per change of every replay, as `fig.changes`
        figs[run.name] = (fig, kinds)
        systems[run.name] = {**fig.to_json(), "actions": run.windows[0].applied,
                             # wall-clock (epoch s) bounds of each replay, for reading the traces again
                             "windows": [{"t_start": w.t_start, "t_stop": round(w.t_stop, 3)} for w in run.windows]}
    base = systems.get(BASELINE)
    for name, s in systems.items():
        s["ratio_vs_baseline"] = (round(s["committed_samples"] / base["committed_samples"], 3)
                                  if base and base["committed_samples"] else None)
    out["systems"] = systems
    if prep.restart is not None:
        efig, ekinds = figs["elasticyolo"]
        rfig, _ = figs[BASELINE]
        restarts = [c.first_step_s for c in rfig.changes if c.first_step_s is not None]
        # A restart cut short by the next change never reached a first step: not a sample of the cost.
        restart_s = (sum(restarts) / len(restarts) if restarts
                     else sum(c.pause_s for c in rfig.changes) / max(1, len(rfig.changes)))
        restart = EventCost(restart_s, 0.0, f"live checkpoint-restart replay: change -> first step of the new "
                                            f"world, mean of {len(restarts)} completed restart(s)")
        proj = project(prep.trace, measured_costs(efig, ekinds, rates, o.notice_fraction), restart,
                       checkpoint_interval_s=o.checkpoint_s, notice_fraction=o.notice_fraction)
        out["projection"] = proj.to_json()
        if rfig.changes:
            out["projection"]["costs_used"]["checkpoint-restart.lost_work"]["live_mean_lost_s"] = round(
                sum(c.lost_samples / rates[c.before] for c in rfig.changes) / len(rfig.changes), 3)
    write_json(o.json_out, out)
    if o.plot_out is not None:
        from elasticyolo.chaos.plot import plot_replay

        plot_replay(out, tl, {name: f for name, (f, _) in figs.items()}, o.plot_out)
    return out
