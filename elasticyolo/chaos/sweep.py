"""`elasticyolo chaos sweep`: the elastic system over every window of a trace that has enough
changes, one cluster and one calibration of the ideal for them all; goodput per window, the worst
and the median.

Which windows: every window of `--hours` that starts on a whole multiple of `--hours` and has at
least `--min-changes` changes of the scaled node count (`sweep_windows`, pure). The rule picks the
windows, not their figures. The windows play one after another on one cluster (each from its own
initial world size, as `--repeats` does for one window), between the calibration of the ideal
before and after them (chaos/runner.py), so a sweep of 7 windows costs one replay's set-up and
calibration instead of 7.
"""

from __future__ import annotations

import math
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from elasticyolo.chaos.replay import (Prepared, ReplayOptions, calibration_span_s, change_kinds, final_world,
                                      ideal_json, job_spec, live_run, prepare, replay_services,
                                      write_json)
from elasticyolo.chaos.schedule import timeline
from elasticyolo.chaos.trace import SpotTrace, TraceError, Window, load_trace


def sweep_windows(trace: SpotTrace, nodes: int, compress: float, hours: float, min_changes: int) -> list[float]:
    """Start hours of every window [k * hours, (k + 1) * hours) inside the trace whose scaled node
    count changes at least `min_changes` times (pure)."""
    if not (hours > 0 and math.isfinite(hours)):
        raise TraceError(f"--hours {hours}: must be > 0")
    if min_changes < 0:
        raise TraceError(f"--min-changes {min_changes}: must be >= 0")
    out = []
    k = 0
    while (k + 1) * hours <= trace.duration_s / 3600.0 + 1e-9:
        start = k * hours
        tl = timeline(trace, Window(start * 3600.0, (start + hours) * 3600.0), nodes, compress)
        if len(tl.changes) >= min_changes:
            out.append(start)
        k += 1
    return out


def prepare_sweep(o: ReplayOptions, min_changes: int) -> list[tuple[float, Prepared]]:
    """Every window's plan, checked before anything starts (one-line errors)."""
    trace = load_trace(o.trace)
    starts = sweep_windows(trace, o.nodes, o.compress, o.hours, min_changes)
    if not starts:
        raise TraceError(f"--min-changes {min_changes}: no {o.hours:g} h window of {o.trace} has that many "
                         f"changes at --nodes {o.nodes}")
    return [(h, prepare(replace(o, start_hour=h, baseline=None, accuracy=False, repeats=1))) for h in starts]


def run_sweep(o: ReplayOptions, min_changes: int, say: Callable[[str], None] = print,
              argv: list[str] | None = None) -> dict[str, Any]:
    windows = prepare_sweep(o, min_changes)
    say(f"trace {o.trace}: {len(windows)} windows of {o.hours:g} h with at least {min_changes} changes at "
        f"{o.nodes} nodes, compressed {o.compress:g}x: hours " + ", ".join(f"{h:g}" for h, _ in windows))

    from elasticyolo.chaos.measure import measure
    from elasticyolo.chaos.runner import Episode, run_elastic
    from elasticyolo.data.synth import SynthSpec, write_dataset

    root = Path(o.workdir or tempfile.mkdtemp(prefix="elasticyolo-sweep-")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    data = write_dataset(root / "data", SynthSpec(train=o.train_images, val=4, imgsz=o.imgsz, classes=2))
    spec = job_spec(o, data)
    ckpt_live_s = o.checkpoint_s / o.compress
    out: dict[str, Any] = {
        "command": "elasticyolo " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "trace": str(o.trace), "nodes": o.nodes, "compress": o.compress, "engine": o.engine, "hours": o.hours,
        "min_changes": min_changes, "seed": o.seed, "notice_fraction": o.notice_fraction, "spec": spec,
        "windows": [{"name": f"hours {h:g}-{h + o.hours:g}", "start_hour": h, "changes": len(p.timeline.changes),
                     "initial_world": p.timeline.initial} for h, p in windows],
    }
    t_begin = time.monotonic()

    def dead(out: dict[str, Any], reason: str) -> None:
        out.update(worst_goodput_vs_ideal=0.0, median_goodput_vs_ideal=0.0)
        for w in out["windows"]:
            w["goodput_vs_ideal"] = 0.0

    with live_run("sweep", o, out, root, t_begin, dead, say):
        with replay_services(o, spec, root, windows[0][1].notice_s, say) as env:
            out["cpus_per_node"] = round(env.slices.cpus, 3) if env.slices else None
            episodes = [Episode(p.elastic, p.timeline.duration_s, final_world(p.timeline)) for _, p in windows]
            say("elasticyolo: calibrating steady-state samples/s per node count, then replaying each window")
            run = run_elastic(env, episodes, o.nodes, calibration_span_s(o.calibrate_s, ckpt_live_s))
    out["wall_s"] = round(time.monotonic() - t_begin, 1)
    rates = dict(run.rates)
    out.update(ideal_json(run))
    for w, (_, p), played in zip(out["windows"], windows, run.windows):
        kinds, delays = change_kinds(p.elastic, p.timeline)
        fig = measure(run.events, t_start=played.t_start, tl=p.timeline, rates=rates, num_samples=o.train_images,
                      change_kinds=kinds, change_delays=delays, until=played.t_stop)
        w.update({k: v for k, v in fig.to_json().items() if k != "changes"},
                 changes_measured=[{**c.__dict__, "pause_s": round(c.pause_s, 2)} for c in fig.changes],
                 t_start=played.t_start, t_stop=round(played.t_stop, 3))
    goodputs = [w["goodput_vs_ideal"] for w in out["windows"]]
    out["worst_goodput_vs_ideal"] = min(goodputs)
    out["median_goodput_vs_ideal"] = round(statistics.median(goodputs), 4)
    # Coverage spans the whole history: the last window's check holds for the run.
    out["duplicates"], out["skipped"] = out["windows"][-1]["duplicates"], out["windows"][-1]["skipped"]
    write_json(o.json_out, out)
    return out


def summary(out: dict[str, Any]) -> str:
    lines = [f"\n{len(out['windows'])} windows of {out['hours']:g} h of {out['trace']} with at least "
             f"{out['min_changes']} changes: K={out['nodes']} F={out['compress']:g} engine={out['engine']}",
             f"{'window':<16}{'changes':>8}{'committed':>10}{'lost':>8}{'goodput/ideal':>15}  pauses s"]
    for w in out["windows"]:
        lines.append(f"{w['name']:<16}{w['changes']:>8}{w.get('committed_samples', 0):>10}"
                     f"{w.get('lost_samples', 0):>8}{w.get('goodput_vs_ideal', 0.0):>15.3f}  "
                     + " ".join(f"{p:.1f}" for p in w.get("pause_s", [])))
    lines.append(f"worst {out['worst_goodput_vs_ideal']:.3f}, median {out['median_goodput_vs_ideal']:.3f}; "
                 f"duplicates {out.get('duplicates', '-')}, skipped {out.get('skipped', '-')}"
                 + (f"; FAILED: {out['reason']}" if out.get("failed") else ""))
    return "\n".join(lines)

