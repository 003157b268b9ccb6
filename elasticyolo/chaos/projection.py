"""The replay's measured per-event costs applied to the whole trace, uncompressed (pure).

Model (docs/chaos.md, "Projection"): useful work is node-seconds of training, the ideal is
the integral of the trace's node count (steady-state throughput taken as linear in nodes). A change
costs a system
  * a pause: seconds in which the new world trains nothing (measured live, per event type);
  * for a join, the new nodes' start-up: they are paid for but idle until the first step of the
    bigger world (measured live: change -> that step);
  * lost work: seconds of the old world's work thrown away. elasticyolo: measured live per event
    type (rollback to the last commit); checkpoint-restart: the time since its last checkpoint,
    simulated with the live checkpoint interval stretched by the compression factor (the same
    interval in trace time); its periodic checkpoints restart with each restored world.
A change arriving during a pause restarts the pause (nothing is lost twice).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from elasticyolo.chaos.trace import SpotTrace


@dataclass(frozen=True)
class EventCost:
    pause_s: float
    lost_work_s: float  # seconds of the old world's work
    measured_from: str  # where the figure came from (e.g. "live elasticyolo replay, 3 events")
    ready_s: float = 0.0  # join: change -> first step with the new nodes (they idle until then)


@dataclass
class Projection:
    duration_s: float
    changes: int
    ideal_node_s: float
    goodput: dict[str, float]
    costs_used: dict[str, dict[str, Any]] = field(default_factory=dict)
    checkpoint_interval_s: float = 0.0
    notice_fraction: float = 1.0

    def to_json(self) -> dict[str, Any]:
        names = list(self.goodput)
        base = self.goodput.get("checkpoint-restart")
        return {
            "trace_hours": round(self.duration_s / 3600, 3), "changes": self.changes,
            "nodes": "as in the trace (no scaling)", "compression": 1,
            "checkpoint_interval_s": round(self.checkpoint_interval_s, 1), "notice_fraction": self.notice_fraction,
            "ideal_node_hours": round(self.ideal_node_s / 3600, 2),
            "systems": {n: {"goodput_vs_ideal": round(self.goodput[n], 4),
                            "ratio_vs_baseline": round(self.goodput[n] / base, 3) if base else None}
                        for n in names},
            "costs_used": self.costs_used,
        }


def _changes(trace: SpotTrace) -> tuple[float, list[tuple[float, int, int]], list[tuple[float, float, int]]]:
    """(start, changes (t, before, after), segments (t0, t1, n)) from the end of the initial ramp."""
    rows = trace.change_times()
    start, n = rows[0]
    segs: list[tuple[float, float, int]] = []
    changes: list[tuple[float, int, int]] = []
    t = start
    for tc, c in rows[1:]:
        if c == n:
            continue
        segs.append((t, tc, n))
        changes.append((tc, n, c))
        t, n = tc, c
    segs.append((t, trace.duration_s, n))
    return start, changes, segs


def _node_seconds(segs: Sequence[tuple[float, float, int]], a: float, b: float) -> float:
    return sum(max(0.0, min(b, t1) - max(a, t0)) * n for t0, t1, n in segs)


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def elastic_goodput(trace: SpotTrace, costs: dict[str, EventCost], notice_fraction: float) -> float:
    _, changes, segs = _changes(trace)
    ideal = sum((t1 - t0) * n for t0, t1, n in segs)
    paused: list[tuple[float, float]] = []
    lost = 0.0
    for i, (tc, before, after) in enumerate(changes):
        if after > before:
            c = costs["join"]
            pause, lost_s = c.pause_s, c.lost_work_s
            # The new nodes are paid for but idle until they have started and joined the world.
            gap = (changes[i + 1][0] if i + 1 < len(changes) else trace.duration_s) - tc
            lost += max(0.0, min(c.ready_s, gap) - pause) * (after - before)
        else:
            cn, ck = costs["kill_notice"], costs["kill_no_notice"]
            pause = notice_fraction * cn.pause_s + (1 - notice_fraction) * ck.pause_s
            lost_s = notice_fraction * cn.lost_work_s + (1 - notice_fraction) * ck.lost_work_s
        paused.append((tc, min(tc + pause, trace.duration_s)))
        lost += lost_s * before
    lost += sum(_node_seconds(segs, a, b) for a, b in _union(paused))
    return max(0.0, (ideal - lost) / ideal)


def restart_goodput(trace: SpotTrace, restart: EventCost, checkpoint_interval_s: float) -> float:
    start, changes, segs = _changes(trace)
    ideal = sum((t1 - t0) * n for t0, t1, n in segs)
    paused: list[tuple[float, float]] = []
    lost = 0.0
    resumed = start  # training (re)started from a checkpoint at this time
    for tc, before, _after in changes:
        if tc >= resumed:
            since = tc - resumed
            if checkpoint_interval_s > 0:
                since -= (since // checkpoint_interval_s) * checkpoint_interval_s
            lost += since * before
        resumed = tc + restart.pause_s
        paused.append((tc, min(resumed, trace.duration_s)))
    lost += sum(_node_seconds(segs, a, b) for a, b in _union(paused))
    return max(0.0, (ideal - lost) / ideal)


def project(trace: SpotTrace, elastic: dict[str, EventCost], restart: EventCost, *,
            checkpoint_interval_s: float, notice_fraction: float) -> Projection:
    start, changes, segs = _changes(trace)
    ideal = sum((t1 - t0) * n for t0, t1, n in segs)
    used = {f"elasticyolo.{k}": {"pause_s": round(v.pause_s, 3), "lost_work_s": round(v.lost_work_s, 3),
                                 **({"ready_s": round(v.ready_s, 3)} if k == "join" else {}),
                                 "measured_from": v.measured_from} for k, v in elastic.items()}
    used["checkpoint-restart.restart"] = {"pause_s": round(restart.pause_s, 3), "measured_from": restart.measured_from}
    used["checkpoint-restart.lost_work"] = {
        "model": f"time since the last checkpoint, one every {checkpoint_interval_s:.0f} s of trace time",
        "measured_from": "live checkpoint interval x compression"}
    return Projection(
        duration_s=trace.duration_s - start, changes=len(changes), ideal_node_s=ideal,
        goodput={"elasticyolo": elastic_goodput(trace, elastic, notice_fraction),
                 "checkpoint-restart": restart_goodput(trace, restart, checkpoint_interval_s)},
        costs_used=used, checkpoint_interval_s=checkpoint_interval_s, notice_fraction=notice_fraction,
    )
