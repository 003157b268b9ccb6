"""Apply a replay plan to a real local cluster (the executor; no torch in this process).

One etcd and one S3 API server (moto), on 127.0.0.1; real nodes (`nodes.py`: `elasticyolo agent`
processes with a cloud metadata server each, or the nodes of a local Ray cluster for engine=ray)
training a real job whose workers write JSONL traces. A system's run: bring up its initial world,
wait until it trains steadily, then play the plan's actions on the replay clock and stop
everything at the window's end.
"""

from __future__ import annotations

import math
import shutil
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from elasticyolo.chaos.measure import steady_rate
from elasticyolo.chaos.nodes import JobFailed, ReplayEnv, ReplayNodes, Say
from elasticyolo.chaos.schedule import Action, Plan

ELASTIC_JOB, RESTART_JOB, REFERENCE_JOB = "replay-elastic", "replay-restart", "replay-reference"
CALIBRATION_SPANS = 3  # per node count; their median rate is the steady state
SETTLE_TIMEOUT_S = 120.0  # for the nodes' standbys to warm before a measurement starts
# The elastic job's first world change comes after at least this many steps at world 1: those
# steps are the uninterrupted run's, bit for bit (the accuracy check), and a run's first steps
# from a random init are chaotic. Measured on a 2-core x86-64 VM: a first change at step 22 left
# the losses equal to 3 decimals through step 30, then they parted, and mAP50-95 at epoch 21 read
# 0.35 against 0.78; with the first change near step 40, five runs were within 0.04.
SHARED_STEPS = 40


@dataclass
class Played:
    """One replay of the window: when its clock started, what was played, when it was over."""

    t_start: float
    applied: list[dict[str, Any]]  # actions as played (seconds from t_start)
    # When the runner moved on (training resumed after the last change, or it gave up): the
    # cluster's stop, or the next replay's return to the initial world, is no part of it.
    t_stop: float


@dataclass
class SystemRun:
    """One system's replays of the window (`repeats`, one after another on one cluster) and the
    workers' trace events."""

    name: str
    windows: list[Played]
    events: list[dict[str, Any]]
    # Each calibration span's samples/s per node count, before the replay and after it.
    span_rates: dict[int, list[float]] = field(default_factory=dict)
    span_rates_after: dict[int, list[float]] = field(default_factory=dict)

    @property
    def rates(self) -> dict[int, float]:
        """Steady-state samples/s per node count: the mean of the median of its spans before the
        replay and the median after it. The machine's speed drifts over minutes (on a shared 2-core VM
        world 2 calibrated at 47.8 samples/s and trained at 29.7 in the replay right after); a calibration
        on both sides of the replay holds the replay's own minutes between them."""
        return {n: statistics.fmean([statistics.median(s) for s in (spans, self.span_rates_after.get(n)) if s])
                for n, spans in self.span_rates.items()}


def _start_clock() -> float:
    """The replay's t=0: the next whole second. AWS's instance-action time has whole seconds
    (`2026-12-04T08:18:53Z`), so a notice announced at a fractional second says the node goes up
    to 1 s before it does: at real scale 1 s of 120, in a replay at 60x up to half of a 2 s notice
    (a drain that measured 0.6 s left and killed its step). The trace's changes lie on whole
    minutes, so at 60x every notice and kill then lies on a whole second, as the time says."""
    t0 = math.ceil(time.time())
    time.sleep(max(0.0, t0 - time.time()))
    return float(t0)


def _play(nodes: ReplayNodes, actions: list[Action], t0: float, t_end: float, say: Say,
          apply: Callable[[Action], None], tail_s: float, final_world: int = 0) -> list[dict[str, Any]]:
    played = []
    for a in actions:
        nodes.wait_until(t0 + a.t)
        if time.time() >= t_end:
            break
        at = time.time()
        apply(a)
        played.append({"t": round(at - t0, 3), "kind": a.kind, "nodes": list(a.nodes), "change": a.change})
        say(f"  t={at - t0:7.2f}s  {a.kind:<8} {' '.join(a.nodes)}"
            + (f"  (killed in {a.notice_s:g}s)" if a.notice_s else ""))
    nodes.wait_until(t_end)
    # Keep going until training resumes after the last action: only then is it known which of
    # the window's steps were rolled back (and what the last change cost).
    last = max([t_end] + [t0 + p["t"] for p in played])
    try:
        nodes.wait_steps(last, 2, tail_s)
        if final_world:
            nodes.wait_world(final_world, t_end, 2, tail_s, f"training at the window's final size {final_world}")
    except JobFailed:
        raise
    except AssertionError as exc:
        say(f"  training did not resume after the window ({exc}); its last change is measured to the window's end")
    return played


def _play_window(nodes: ReplayNodes, name: str, n0: int, repeat: int, repeats: int, actions: list[Action],
                 duration_s: float, apply: Callable[[Action], None], final_world: int, after: float) -> Played:
    """One replay of the window, once the world of `n0` has trained 5 steps after `after`, a
    checkpoint is in the store and every standby is warm."""
    env = nodes.env
    nodes.wait_world(n0, after, 5, env.startup_timeout_s, f"steady training at world size {n0}")
    nodes.wait_checkpoint(env.startup_timeout_s)
    nodes.settle(SETTLE_TIMEOUT_S)
    t0 = _start_clock()
    env.say(f"{name}: replay {repeat + 1} of {repeats} starts at world size {n0}" if repeats > 1
            else f"{name}: replay starts at world size {n0}")
    played = _play(nodes, actions, t0, t0 + duration_s, env.say, apply, env.startup_timeout_s, final_world)
    return Played(t0, played, time.time())


def _repeat_plan(plan: Plan, live: list[str], repeat: int) -> Plan:
    """The plan for replay `repeat` (from 0): its initial nodes are the first live ones, every node
    it starts gets a name of its own."""
    if repeat == 0:
        return plan
    names = dict(zip(plan.initial_nodes, live))
    return plan.renamed(lambda n: names.get(n, f"{n}r{repeat}"))


@dataclass(frozen=True)
class Episode:
    """One window to play: its plan, its length (replay seconds) and the world size it ends at."""

    plan: Plan
    duration_s: float
    final_world: int = 0


def run_elastic(env: ReplayEnv, episodes: Sequence[Episode], max_nodes: int, calibrate_s: float,
                shared_steps: int = 0) -> SystemRun:
    """elasticyolo: calibrate steady-state samples/s at 1..max_nodes nodes (one node joining at a
    time, no failures), replay each episode in turn (the same window repeated, or several windows
    of a sweep), each from its own initial world size, then calibrate again from max_nodes down to
    1 (one node leaving at a time). `shared_steps`: the first node trains at least that many steps
    alone before the second joins (`SHARED_STEPS`)."""
    say = env.say
    job = ELASTIC_JOB
    nodes = env.nodes(env, job, env.workdir / "elasticyolo")
    plan = episodes[0].plan
    extra = [f"x{i}" for i in range(1, max_nodes - len(plan.initial_nodes) + 1)]
    ramp = plan.initial_nodes + extra
    span_rates: dict[int, list[float]] = {}
    try:
        nodes.begin(ramp[0])
        nodes.submit(max_nodes)
        for n in range(1, max_nodes + 1):
            if n > 1:
                nodes.start(ramp[n - 1])
            span_rates[n] = _calibrate_at(nodes, n, calibrate_s, "before the replay")
            if n == 1 and shared_steps:
                nodes.wait_steps(0.0, shared_steps, env.startup_timeout_s + shared_steps * 30.0)
        _leave(nodes, extra)  # back to the first window's initial size

        def apply(a: Action) -> None:
            if a.kind == "start":
                for n in a.nodes:
                    nodes.start(n)
            elif a.kind == "notice":
                for n in a.nodes:
                    nodes.notice(n, a.notice_s or 0.0)
            elif a.kind == "kill":
                for n in a.nodes:
                    nodes.kill(n)

        windows = []
        for r, episode in enumerate(episodes):
            n0 = len(episode.plan.initial_nodes)
            live = nodes.live()
            if r:  # to the episode's initial size: the newest nodes leave, or new ones join
                _leave(nodes, live[n0:])
                fresh = [f"s{r}n{i}" for i in range(1, n0 - len(live) + 1)]
                for n in fresh:
                    nodes.start(n)
                live = live[:n0] + fresh
            windows.append(_play_window(nodes, "elasticyolo", n0, r, len(episodes),
                                        _repeat_plan(episode.plan, live, r).actions, episode.duration_s, apply,
                                        episode.final_world, after=time.time()))
        # The calibration again, from max_nodes down to one node (one leaving at a time, with a
        # notice): the replay's minutes lie between the two.
        say("elasticyolo: calibrating again after the replay, from the largest world down")
        after: dict[int, list[float]] = {}
        live = nodes.live()
        more = [f"y{i}" for i in range(1, max_nodes - len(live) + 1)]
        for y in more:
            nodes.start(y)
        order = more + live  # who leaves first
        for n in range(max_nodes, 0, -1):
            after[n] = _calibrate_at(nodes, n, calibrate_s, "after the replay")
            if n > 1:
                _leave(nodes, [order[max_nodes - n]])
        events = nodes.events()
        nodes.stop()
        return SystemRun("elasticyolo", windows, events, span_rates, after)
    finally:
        nodes.stop()


def _calibrate_at(nodes: ReplayNodes, n: int, calibrate_s: float, when: str) -> list[float]:
    """Samples/s of CALIBRATION_SPANS spans at world size `n` once it trains and has settled.
    The steady state is their median: the best of a few short spans is biased upward by the
    machine's noise, and their pooled mean downward by a transient the settling missed (seen on
    2 cores: world 3's spans at 21, 46 and 47 samples/s; 49 to 71 for the best of two across runs)."""
    env = nodes.env
    nodes.wait_world(n, time.time(), 3, env.startup_timeout_s, f"training at world size {n}")
    t_formed = time.time()
    nodes.settle(SETTLE_TIMEOUT_S)  # the nodes' standbys warm up
    nodes.wait_until(t_formed + calibrate_s)  # and the change's own transient
    spans = []
    for _ in range(CALIBRATION_SPANS):
        t_a = time.time()
        # A span: at least calibrate_s and at least 5 steps at this size.
        nodes.wait(lambda: time.time() - t_a >= calibrate_s and nodes.steps_after(t_a, n, 5),
                   env.startup_timeout_s, f"5 steps at world size {n}")
        got = steady_rate(nodes.events(), t_a, time.time(), n)
        if got is not None:
            spans.append(got)
    if not spans:
        raise RuntimeError(f"no steady steps at world size {n} to measure")
    env.say(f"ideal: {n} node(s) train {statistics.median(spans):.1f} samples/s {when} (median of {len(spans)} x "
            f"{calibrate_s:g}s; spans {', '.join(f'{r:.1f}' for r in spans)})")
    return spans


def _leave(nodes: ReplayNodes, leaving: list[str]) -> None:
    """Calibration nodes leave as a spot node does: a notice, then gone."""
    for x in leaving:
        nodes.notice(x, nodes.env.notice_s)
    t_drop = time.time()
    if leaving:
        nodes.wait(lambda: all(not nodes.alive(x) or time.time() > t_drop + nodes.env.notice_s for x in leaving),
                   nodes.env.notice_s + 30, "the calibration nodes to leave", interval=0.2)
        for x in leaving:
            nodes.kill(x)


def run_checkpoint_restart(env: ReplayEnv, plan: Plan, duration_s: float, max_nodes: int,
                           final_world: int = 0, repeats: int = 1) -> SystemRun:
    """The stop-the-world baseline: every change SIGKILLs every node and starts a fresh world of
    the new size (new node names: nothing node-local survives), which restores the newest S3
    checkpoint of the same job. `repeats`: the window again, each time from a fresh world of its
    initial size (a restart, as the baseline makes every change)."""
    job = RESTART_JOB
    nodes = env.nodes(env, job, env.workdir / "checkpoint-restart")
    try:
        nodes.begin(plan.initial_nodes[0])
        for n in plan.initial_nodes[1:]:
            nodes.start(n)
        nodes.submit(max_nodes)
        n0 = len(plan.initial_nodes)

        def apply(a: Action) -> None:
            for n in nodes.live():
                nodes.kill(n)
            for n in a.nodes:
                nodes.start(n)

        windows = []
        for r in range(repeats):
            this = plan.renamed(lambda n: f"s{r}{n}") if r else plan
            if r:
                apply(Action(0.0, "restart", tuple(this.initial_nodes)))
            windows.append(_play_window(nodes, "checkpoint-restart", n0, r, repeats, this.actions, duration_s, apply,
                                        final_world, after=time.time() if r else 0.0))
        events = nodes.events()
        nodes.stop()
        return SystemRun("checkpoint-restart", windows, events)
    finally:
        nodes.stop()


def run_reference(env: ReplayEnv, job: str, world: int, max_nodes: int, until_epoch: int, timeout_s: float) -> None:
    """An uninterrupted run for the accuracy check: `world` nodes, no changes, until the job's
    checkpoint of epoch `until_epoch`'s end has landed (a later epoch's checkpoint is in etcd).
    No accelerator quota: it computes the same steps whatever its speed (one thread, as in the
    replay), and the host's idle cores finish them in a third of the time."""
    nodes = env.nodes(env, job, env.workdir / "reference", sliced=False)
    try:
        nodes.begin("r1")
        for i in range(1, world):
            nodes.start(f"r{i + 1}")
        nodes.submit(max_nodes)
        nodes.wait(lambda: (nodes.checkpoint_epoch() or -1) > until_epoch, timeout_s,
                   f"the uninterrupted run past epoch {until_epoch}", interval=1.0)
    finally:
        nodes.stop()


def clean(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
