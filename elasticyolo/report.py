"""`elasticyolo report`: a job's timeline as one PNG. World size, samples/s, loss and mAP over wall
time, with the cluster's events marked (join, leave, kill, notice, drain, checkpoint, leader change).

Sources, each optional: the run folder's time series (`train/timeline.py`; local, or published
under `<job>/run/timeline/` in the checkpoint store), the store's checkpoint manifests, and the
job's event log in etcd (`events/`, written by the agents). No torch; matplotlib (Agg) draws.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

# event kind -> (label, colour) on the plot
MARKS = {
    "join": ("join", "tab:green"), "leave": ("leave", "tab:gray"), "kill": ("kill", "tab:red"),
    "notice": ("spot notice", "tab:orange"), "drain": ("drain", "tab:purple"),
    "checkpoint": ("checkpoint", "tab:blue"), "leader": ("leader change", "black"),
}
KILL_WINDOW_S = 30.0  # a world shrink without a leave/drain this close before it is a kill


@dataclass
class Timeline:
    series: list[dict[str, Any]] = field(default_factory=list)  # sorted by "t"
    events: list[dict[str, Any]] = field(default_factory=list)  # {"t", "kind" (a MARKS key), "node", "detail"}

    def add_events(self, events: Iterable[dict[str, Any]]) -> None:
        self.events = sorted([*self.events, *events], key=lambda e: e["t"])


def parse_series(chunks: Iterable[bytes | str]) -> list[dict[str, Any]]:
    rows = []
    for chunk in chunks:
        text = chunk.decode(errors="replace") if isinstance(chunk, bytes) else chunk
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(row, dict) and isinstance(row.get("t"), (int, float)):
                rows.append(row)
    return sorted(rows, key=lambda r: r["t"])


def cluster_events(raw: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The agents' event records as timeline marks."""
    out = []
    for ev in raw:
        at, kind = ev.get("at"), ev.get("kind")
        if not isinstance(at, (int, float)):
            continue
        node = str(ev.get("node") or "")
        if kind == "state" and ev.get("to") == "TRAINING":
            out.append({"t": at, "kind": "join", "node": node, "detail": f"{node} training"})
        elif kind == "state" and ev.get("to") in ("LEFT", "FAILED"):
            out.append({"t": at, "kind": "leave", "node": node, "detail": f"{node} {ev['to'].lower()}"})
        elif kind == "notice":
            out.append({"t": at, "kind": "notice", "node": node,
                        "detail": f"{node} {ev.get('provider')} {ev.get('notice_kind')}"})
        elif kind == "drain_start":
            out.append({"t": at, "kind": "drain", "node": node, "detail": f"{node} drain ({ev.get('reason')})"})
        elif kind == "leader":
            out.append({"t": at, "kind": "leader", "node": node, "detail": f"{node} leads (term {ev.get('term')})"})
    return out


def checkpoint_events(manifests: Iterable[Any]) -> list[dict[str, Any]]:
    return [{"t": m.created, "kind": "checkpoint", "node": "", "detail": f"step {m.step}"} for m in manifests]


def inferred_kills(series: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """World shrinks that no leave or drain explains: a node died (a spot reclaim without notice,
    a crash, a SIGKILL)."""
    explained = [e["t"] for e in events if e["kind"] in ("leave", "drain", "notice")]
    out = []
    prev = None
    for row in series:
        world = row.get("world")
        if prev is not None and isinstance(world, int) and isinstance(prev.get("world"), int) and world < prev["world"]:
            if not any(prev["t"] - KILL_WINDOW_S <= t <= row["t"] for t in explained):
                out.append({"t": prev["t"], "kind": "kill", "node": "",
                            "detail": f"world {prev['world']} -> {world}"})
        prev = row
    return out


def gather(job: str, *, run_dir: str | Path | None = None, store: Any = None, client: Any = None,
           keys: Any = None) -> Timeline:
    from elasticyolo.checkpoint.layout import run_key

    tl = Timeline()
    chunks: list[bytes] = []
    if run_dir is not None:
        chunks += [p.read_bytes() for p in sorted((Path(run_dir) / "timeline").glob("*.jsonl"))]
    if store is not None:
        from elasticyolo.checkpoint import catalog

        local_names = {p.name for p in (Path(run_dir) / "timeline").glob("*.jsonl")} if run_dir else set()
        for info in store.list(run_key(job, "timeline/")):
            if info.key.rsplit("/", 1)[-1] not in local_names:
                chunks.append(store.get_bytes(info.key))
        tl.add_events(checkpoint_events(catalog.list_manifests(store, job)))
    tl.series = parse_series(chunks)
    if client is not None and keys is not None:
        raw = []
        for _key, value, _rev in client.get_prefix(keys.events):
            try:
                raw.append(json.loads(value))
            except ValueError:
                continue
        tl.add_events(cluster_events(raw))
    tl.add_events(inferred_kills(tl.series, tl.events))
    return tl


def render(tl: Timeline, out: str | Path, title: str = "") -> Path:
    """Four panels over wall time (minutes from the first record): world size, samples/s, loss, mAP."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    times = [r["t"] for r in tl.series] + [e["t"] for e in tl.events]
    if not times:
        raise ValueError("nothing to draw: no time series and no events")
    t0 = min(times)

    def minutes(t: float) -> float:
        return (t - t0) / 60.0

    fig, axes = plt.subplots(4, 1, figsize=(12, 9), sharex=True, tight_layout=True)
    panels = [("world", "world size", "steps-post"), ("samples_s", "samples/s", None), ("loss", "loss", None),
              ("mAP50-95", "mAP50-95", None)]
    for ax, (key, label, draw) in zip(axes, panels):
        pts = [(minutes(r["t"]), r[key]) for r in tl.series if isinstance(r.get(key), (int, float))]
        if pts:
            xs, ys = zip(*pts)
            if draw:
                ax.step(xs, ys, where="post", linewidth=2)
            else:
                ax.plot(xs, ys, marker="." if key == "mAP50-95" else None, linewidth=1.5)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    seen: set[str] = set()
    for ev in tl.events:
        label, colour = MARKS.get(ev["kind"], (ev["kind"], "tab:brown"))
        for i, ax in enumerate(axes):
            ax.axvline(minutes(ev["t"]), color=colour, alpha=0.6, linewidth=1,
                       linestyle=":" if ev["kind"] == "checkpoint" else "--",
                       label=label if i == 0 and label not in seen else None)
        seen.add(label)
    if seen:
        axes[0].legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    axes[-1].set_xlabel("minutes")
    if title:
        axes[0].set_title(title)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
