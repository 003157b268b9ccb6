"""The replay's timeline as a PNG (matplotlib, Agg): per system, the trace's node count, the world
size the workers trained at, committed samples/s, and the actions played."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from elasticyolo.chaos.measure import SystemFigures
from elasticyolo.chaos.schedule import ReplayTimeline

COLORS = {"start": "tab:green", "notice": "tab:orange", "kill": "tab:red", "restart": "tab:purple"}


def plot_replay(out: dict[str, Any], tl: ReplayTimeline, figs: dict[str, SystemFigures], path: Path) -> None:
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(figs)
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 3.4 * len(names)), sharex=True, squeeze=False)
    seg_t = [s.t0 for s in tl.segments()] + [tl.duration_s]
    seg_n = [s.nodes for s in tl.segments()]
    for ax, name in zip(axes[:, 0], names):
        f = figs[name]
        ax.step(seg_t, seg_n + seg_n[-1:], where="post", color="black", lw=1.5, label="nodes (trace, scaled)")
        ax.plot(f.series["world_t"], f.series["world"], ".", ms=3, color="tab:blue", label="world size (steps)")
        ax.set_ylabel("nodes")
        ax.set_ylim(0, max(seg_n + f.series["world"] + [1]) + 1)
        rate = ax.twinx()
        # A step can take longer than a second: a 5 s moving average reads as a rate.
        width = min(5, len(f.series["samples_per_s"])) or 1
        smooth = np.convolve(f.series["samples_per_s"], np.ones(width) / width, mode="same")
        rate.plot(f.series["t"], smooth, color="tab:gray", lw=1.0, alpha=0.9,
                  label=f"committed samples/s ({width} s mean)")
        rate.set_ylabel("samples/s")
        rate.set_ylim(bottom=0)
        for a in out["systems"][name]["actions"]:
            ax.axvline(a["t"], color=COLORS.get(a["kind"], "k"), lw=0.8, ls="--", alpha=0.7)
        s = out["systems"][name]
        n = len(s.get("repeats", ()))
        ax.set_title(f"{name}: goodput vs ideal {s['goodput_vs_ideal']:.3f}, committed {s['committed_samples']}, "
                     f"lost {s['lost_samples']}" + (f", ratio vs baseline {s['ratio_vs_baseline']}"
                                                      if s.get("ratio_vs_baseline") else "")
                     + (f" (means of {n} replays; the first one shown)" if n > 1 else ""), fontsize=10)
        handles = ax.get_legend_handles_labels()[0] + rate.get_legend_handles_labels()[0]
        handles += [plt.Line2D([], [], color=c, ls="--", label=k) for k, c in COLORS.items()]
        ax.legend(handles=handles, loc="lower left", fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel(f"replay seconds (trace {out['window']['name']}, compressed {out['compress']:g}x, "
                           f"{out['nodes']} nodes)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
