"""`elasticyolo chaos replay`: replay a window of a real spot trace against local agents and a
checkpoint-restart baseline; goodput against the ideal, JSON and a PNG timeline. `elasticyolo chaos
sweep`: every window of a trace with enough changes, on one cluster; goodput per window, the worst
and the median."""

from __future__ import annotations

import argparse
from pathlib import Path

from elasticyolo.engines.names import DEFAULT, names


def _window_arguments(p: argparse.ArgumentParser) -> None:
    """What a replay and a sweep share: the trace and its scale, the job, the nodes, the output."""
    p.add_argument("--trace", type=Path, required=True, help="CSV of time_ms,node_count rows (no header)")
    p.add_argument("--nodes", type=int, required=True, help="K: local nodes the trace's maximum maps to")
    p.add_argument("--compress", type=float, required=True, help="F: time compression factor")
    p.add_argument("--engine", choices=names(), default=DEFAULT,
                   help="the job's engine (any registered one, docs/engines.md)")
    p.add_argument("--notice-s", type=float, default=None, help="spot notice before a kill (default 120 / F)")
    p.add_argument("--notice-fraction", type=float, default=1.0, help="P: share of kills with a notice")
    p.add_argument("--seed", type=int, default=0, help="chooses the victims and which get a notice")
    p.add_argument("--model", default="yolov8n.yaml")
    p.add_argument("--imgsz", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--train-images", type=int, default=512, help="size of the generated training set")
    p.add_argument("--checkpoint-s", type=float, default=300.0,
                   help="seconds of trace time between periodic S3 checkpoints (live: this / F)")
    p.add_argument("--calibrate-s", type=float, default=8.0, help="seconds per calibration span of the ideal (rounded up to whole checkpoint intervals)")
    p.add_argument("--cpus-per-node", type=float, default=None,
                   help="CPU quota of each simulated node's accelerator (cgroup; the node's agent, standby and "
                        "uploader run beside it); default: the host's cores less 0.5, split evenly over K; "
                        "0: the nodes share the CPUs")
    p.add_argument("--set", dest="spec", action="append", default=[], metavar="KEY=VALUE",
                   help="extra training option for the job (repeatable)")
    p.add_argument("--json", dest="json_out", type=Path, required=True, help="write the figures here")
    p.add_argument("--workdir", type=Path, default=None, help="data, logs and traces (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the work dir")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    p = sub.add_parser("replay", help="replay a spot trace window (see docs/chaos.md)")
    _window_arguments(p)
    p.add_argument("--start-hour", type=float, required=True, help="H: window start, trace hours")
    p.add_argument("--hours", type=float, required=True, help="D: window length, trace hours")
    p.add_argument("--baseline", choices=("checkpoint-restart", "none"), default="checkpoint-restart",
                   help="also replay the window with a stop-the-world checkpoint-restart system (default)")
    p.add_argument("--repeats", type=int, default=1,
                   help="replay the window N times per system, back to its initial world before each; "
                        "figures are the means per replay, each replay's are in the JSON")
    p.add_argument("--plot", dest="plot_out", type=Path, default=None, help="write the PNG timeline here")
    p.add_argument("--no-accuracy", dest="accuracy", action="store_false",
                   help="skip the final mAP comparison with an uninterrupted run to the same epoch")
    s = sub.add_parser("sweep", help="replay every window of a trace with enough changes; worst and median goodput")
    _window_arguments(s)
    s.add_argument("--hours", type=float, default=1.0, help="D: window length, trace hours (windows start on multiples of it)")
    s.add_argument("--min-changes", type=int, default=3, help="windows with at least this many node-count changes")


def run(args: argparse.Namespace) -> int:
    import signal
    import sys

    from elasticyolo.chaos.replay import ReplayOptions, run_replay
    from elasticyolo.chaos.sweep import run_sweep
    from elasticyolo.chaos.sweep import summary as sweep_summary

    # SIGTERM (a `kill`, a CI timeout) stops the replay like Ctrl-C: its clean-up stops every
    # agent, worker and server it started instead of leaving them running.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    sweep = args.action == "sweep"
    opts = ReplayOptions(
        trace=args.trace, nodes=args.nodes, compress=args.compress, start_hour=0.0 if sweep else args.start_hour,
        hours=args.hours, json_out=args.json_out, plot_out=None if sweep else args.plot_out, engine=args.engine,
        baseline=None if sweep or args.baseline == "none" else args.baseline, notice_s=args.notice_s,
        notice_fraction=args.notice_fraction, seed=args.seed, model=args.model, imgsz=args.imgsz,
        batch=args.batch, train_images=args.train_images, checkpoint_s=args.checkpoint_s,
        calibrate_s=args.calibrate_s, spec=list(args.spec), workdir=args.workdir, keep=args.keep,
        accuracy=False if sweep else args.accuracy, cpus_per_node=args.cpus_per_node,
        repeats=1 if sweep else args.repeats,
    )
    if sweep:
        out = run_sweep(opts, args.min_changes, say=lambda m: print(m, flush=True))
        print(sweep_summary(out), flush=True)
        print(f"figures: {args.json_out}", flush=True)
        return 0
    out = run_replay(opts, say=lambda m: print(m, flush=True))
    print(summary(out), flush=True)
    print(f"figures: {args.json_out}" + (f", timeline: {args.plot_out}" if args.plot_out else ""), flush=True)
    return 0


def summary(out: dict) -> str:  # type: ignore[type-arg]
    lines = [f"\nwindow {out['window']['name']} of {out['trace']}: K={out['nodes']} F={out['compress']:g} "
             f"engine={out['engine']} ({len(out['changes'])} changes; "
             + (f"{out['cpus_per_node']:g} CPUs per node)" if out.get("cpus_per_node") else "nodes share the CPUs)")]
    lines.append(f"{'system':<20}{'committed':>10}{'lost':>8}{'goodput/ideal':>15}{'vs baseline':>13}"
                 f"{'dup':>5}{'skip':>5}  pauses s")
    for name, s in out["systems"].items():
        lines.append(f"{name:<20}{s['committed_samples']:>10}{s['lost_samples']:>8}{s['goodput_vs_ideal']:>15.3f}"
                     f"{str(s['ratio_vs_baseline']):>13}{s['duplicates']:>5}{s['skipped']:>5}  "
                     + " ".join(f"{p:.1f}" for p in s["pause_s"]))
        for i, r in enumerate(s.get("repeats", []), 1):
            lines.append(f"{'  replay ' + str(i):<20}{r['committed_samples']:>10}{r['lost_samples']:>8}"
                         f"{r['goodput_vs_ideal']:>15.3f}")
    if "projection" in out:
        p = out["projection"]
        lines.append(f"projection (whole trace, {p['trace_hours']} h, {p['changes']} changes, uncompressed): "
                     + ", ".join(f"{n} goodput/ideal {s['goodput_vs_ideal']:.3f} (x{s['ratio_vs_baseline']})"
                                 for n, s in p["systems"].items()))
    acc = out.get("accuracy")
    if acc and "map50_95_difference" in acc:
        lines.append(f"accuracy at the end of epoch {acc['epoch']}: mAP50-95 {acc['elasticyolo']['mAP50-95']:.4f} "
                     f"vs {acc['uninterrupted']['mAP50-95']:.4f} uninterrupted (world {acc['uninterrupted']['world']}): "
                     f"difference {acc['map50_95_difference']:.4f} "
                     + ("within" if acc["within_tolerance"] else "NOT within") + f" {acc['tolerance']:g}")
    elif acc:
        lines.append(f"accuracy: {acc.get('error') or acc}")
    return "\n".join(lines)
