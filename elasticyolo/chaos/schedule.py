"""Map a window of a spot trace to what happens to local nodes (pure; stepped in unit tests).

Node count: round(count * K / max count) (half up), time compressed F times. A decrease picks its
victims among the live nodes with a seeded RNG; each gets, with probability P, a spot notice S
seconds before it is killed (the cloud announces first, then takes the VM), otherwise a plain
SIGKILL. An increase starts new nodes (new names: a replacement VM is a new node).

The checkpoint-restart baseline turns every change into one `restart`: every node stops and a
fresh world of the new size starts from the newest checkpoint.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Callable

from elasticyolo.chaos.trace import SpotTrace, TraceError, Window


def scale_count(count: int, nodes: int, max_count: int) -> int:
    """round(count * nodes / max_count), halves rounded up (Python's round() would round to even)."""
    return int(math.floor(count * nodes / max_count + 0.5))


@dataclass(frozen=True)
class Change:
    t: float  # replay seconds from the window's start (compressed)
    trace_t: float  # trace seconds
    before: int  # scaled node counts
    after: int


@dataclass(frozen=True)
class Segment:
    """[t0, t1) replay seconds at `nodes` scaled nodes (for the ideal and the plot)."""

    t0: float
    t1: float
    nodes: int


@dataclass(frozen=True)
class ReplayTimeline:
    initial: int
    changes: tuple[Change, ...]
    duration_s: float  # replay seconds
    compress: float

    def segments(self) -> list[Segment]:
        out, t, n = [], 0.0, self.initial
        for c in self.changes:
            if c.t > t:
                out.append(Segment(t, c.t, n))
            t, n = c.t, c.after
        if self.duration_s > t:
            out.append(Segment(t, self.duration_s, n))
        return out

    def nodes_at(self, t: float) -> int:
        n = self.initial
        for c in self.changes:
            if c.t > t:
                break
            n = c.after
        return n


def timeline(trace: SpotTrace, window: Window, nodes: int, compress: float) -> ReplayTimeline:
    """The window's scaled node count over compressed time; one-line error for impossible scales."""
    if nodes < 1:
        raise TraceError(f"--nodes {nodes}: must be >= 1")
    if compress <= 0:
        raise TraceError(f"--compress {compress}: must be > 0")
    top = trace.max_count
    initial = scale_count(trace.count_at(window.start_s), nodes, top)
    changes: list[Change] = []
    current = initial
    for t, count in trace.change_times():
        if not window.start_s < t < window.end_s:
            continue
        scaled = scale_count(count, nodes, top)
        if scaled != current:
            changes.append(Change((t - window.start_s) / compress, t, current, scaled))
            current = scaled
    low = min([initial] + [c.after for c in changes])
    if low < 1:
        raise TraceError(f"--nodes {nodes}: the window scales to 0 nodes at some point "
                         f"(count {min(c for _, c in trace.rows if c > 0)} of {top}); use more nodes")
    return ReplayTimeline(initial, tuple(changes), window.duration_s / compress, compress)


@dataclass(frozen=True)
class Action:
    t: float  # replay seconds
    kind: str  # "start" | "notice" | "kill" | "restart"
    nodes: tuple[str, ...]
    notice_s: float | None = None  # for "notice": seconds until the kill
    change: int = -1  # index of the trace change that caused it


@dataclass
class Plan:
    initial_nodes: list[str]
    actions: list[Action] = field(default_factory=list)

    def renamed(self, name: Callable[[str], str]) -> Plan:
        """The same plan with every node renamed (a repeat of the window: the same changes and
        victims, played on the nodes now live and on new ones)."""
        return Plan([name(n) for n in self.initial_nodes],
                    [replace(a, nodes=tuple(name(n) for n in a.nodes)) for a in self.actions])

    def victims(self) -> list[tuple[float, str, bool]]:
        """(time, node, with notice) per killed node, for printing."""
        noticed = {n for a in self.actions if a.kind == "notice" for n in a.nodes}
        return [(a.t, n, n in noticed) for a in self.actions if a.kind == "kill" for n in a.nodes]


def node_name(i: int) -> str:
    return f"n{i}"


def plan_elastic(tl: ReplayTimeline, *, notice_s: float, notice_fraction: float, seed: int) -> Plan:
    """Kills (with or without a notice) and joins for the elastic system."""
    if not 0.0 <= notice_fraction <= 1.0:
        raise TraceError(f"--notice-fraction {notice_fraction}: must be within [0, 1]")
    if notice_s < 0:
        raise TraceError(f"--notice-s {notice_s}: must be >= 0")
    rng = random.Random(seed)
    serial = tl.initial
    live = [node_name(i) for i in range(1, tl.initial + 1)]
    plan = Plan(list(live))
    for idx, c in enumerate(tl.changes):
        if c.after > c.before:
            new = [node_name(serial + i) for i in range(1, c.after - c.before + 1)]
            serial += len(new)
            live.extend(new)
            plan.actions.append(Action(c.t, "start", tuple(new), change=idx))
            continue
        victims = sorted(rng.sample(live, c.before - c.after), key=live.index)
        for v in victims:
            live.remove(v)
            if notice_s > 0 and rng.random() < notice_fraction:
                plan.actions.append(Action(c.t, "notice", (v,), notice_s=notice_s, change=idx))
                plan.actions.append(Action(c.t + notice_s, "kill", (v,), change=idx))
            else:
                plan.actions.append(Action(c.t, "kill", (v,), change=idx))
    plan.actions.sort(key=lambda a: (a.t, a.change))
    return plan


def plan_checkpoint_restart(tl: ReplayTimeline) -> Plan:
    """Every change: all nodes stop, a fresh world of the new size starts (new node names, so no
    node-local state survives: the world restores from the checkpoint store)."""
    gen = 0

    def world(g: int, n: int) -> list[str]:
        return [f"g{g}n{i}" for i in range(1, n + 1)]

    plan = Plan(world(gen, tl.initial))
    for idx, c in enumerate(tl.changes):
        gen += 1
        plan.actions.append(Action(c.t, "restart", tuple(world(gen, c.after)), change=idx))
    return plan
