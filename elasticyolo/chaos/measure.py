"""Figures from the workers' JSONL traces (`train/loop.py` TraceWriter), pure over the events.

* committed samples: step records inside the replay window that no later `resume` rolled back
  (a resume at step s discards the steps above s recorded before it, but not those of its own
  round: `committed_records`);
* lost samples: every other step record inside the window (executions a rollback or a restart
  threw away);
* pauses: per trace change, the longest stretch without a step that ends after the change (and
  starts before the next one), minus one typical step time (the median gap between steps);
* duplicates / skipped: per completed epoch of the final history, samples trained twice / never;
* steady-state samples/s for a world size: samples of the steps after the first one over the time
  from the first to the last step of a stretch at that size with no change (the ideal's
  calibration takes the median of several such spans).
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from elasticyolo.chaos.schedule import ReplayTimeline

Event = dict[str, Any]


def step_records(events: Sequence[Event]) -> list[Event]:
    return [e for e in events if e.get("ev") == "step"]


def committed_records(events: Sequence[Event], until: float = float("inf")) -> list[Event]:
    """Step records never rolled back: a `resume` at step s (a reset's rollback, a restore from a
    snapshot or checkpoint) discards every step above s recorded before it, except those of its
    own round. A rank writes its step record before the step's all-reduce (train/loop.py), so a
    fast rank's first step of a new world can precede a slow peer's resume of that same world:
    a record by a worker whose own latest resume was at step s into world w is not discarded by
    a resume at step s into world w. A record written after another worker resumed into a round
    newer than the writer's own is stale whatever its step: its round is over, so its all-reduce
    failed (seen: a frozen worker, thawed mid-step, recorded that step after the survivors'
    world had redone it). Resumes after `until` (the runner's shutdown) do not count.

    A round is its resumes' (step, world) and a count of earlier rounds with that pair: a resume
    at (s, w) begins another round after a step record at world w of step s + 2 or later, written
    since the last resume at (s, w), since no rank of one round records s + 2 before all its
    peers resumed (step s + 1's all-reduce needs them); and when its rank has already resumed in
    the latest round at (s, w), since a round resumes each rank once. Seen: a checkpoint-restart
    world of 3 that trained 2 steps and checkpointed neither, replaced by a world of 3 that
    restored the same checkpoint; as one round, both executions of those steps counted: 48
    duplicates. After one step only, the rank rule alone tells them apart (such a baseline showed 48 and
    96 duplicates without it). (Time apart would not tell: a frozen or starved rank can resume
    seconds after its peers.)"""
    Round = tuple[int, Any, int]  # (step resumed at, world size, earlier rounds with both)
    records = sorted((e["t"], e["step"], e.get("world")) for e in events if e.get("ev") == "step")
    record_times = [t for t, _, _ in records]
    resumes: list[tuple[float, Round]] = []
    round_of: dict[int, Round] = {}  # id(resume event) -> its round
    latest: dict[tuple[int, Any], tuple[float, int]] = {}  # (step, world) -> (last resume time, count)
    resumed: dict[tuple[int, Any], set[Any]] = defaultdict(set)  # (step, world) -> ranks in its latest round
    for e in sorted((e for e in events if e.get("ev") == "resume" and e["t"] <= until), key=lambda e: e["t"]):
        pair, rank = (e["step"], e.get("world")), e.get("rank")
        last_t, k = latest.get(pair, (float("-inf"), -1))
        lo, hi = bisect.bisect_right(record_times, last_t), bisect.bisect_left(record_times, e["t"])
        if (k < 0 or (rank is not None and rank in resumed[pair])
                or any(w == pair[1] and step >= pair[0] + 2 for _, step, w in records[lo:hi])):
            k += 1
            resumed[pair] = set()
        resumed[pair].add(rank)
        latest[pair] = (e["t"], k)
        round_of[id(e)] = (*pair, k)
        resumes.append((e["t"], round_of[id(e)]))
    # lowest[i]: the two rounds with the lowest steps among resumes[i:] (two different rounds, so
    # that the lowest one other than a record's own round is at hand).
    lowest: list[list[Round]] = [[] for _ in range(len(resumes) + 1)]
    for i in range(len(resumes) - 1, -1, -1):
        later = lowest[i + 1]
        rnd = resumes[i][1]
        lowest[i] = later if rnd in later else sorted([rnd, *later], key=lambda r: r[0])[:2]
    times = [t for t, _ in resumes]
    own: dict[Any, tuple[int, Round]] = {}  # pid -> (index in resumes, round) of its latest resume so far
    out = []
    for e in sorted(events, key=lambda e: e["t"]):
        if e.get("ev") == "resume" and e["t"] <= until:
            own[e.get("pid")] = (bisect.bisect_right(times, e["t"]) - 1, round_of[id(e)])
        elif e.get("ev") == "step":
            mine = own.get(e.get("pid"))
            now = bisect.bisect_right(times, e["t"])
            if mine is not None and any(r != mine[1] for _, r in resumes[mine[0] + 1:now]):
                continue  # its round is over: a newer one began before this record
            others = [r for r in lowest[now] if r != (mine[1] if mine else None)]
            if not others or e["step"] <= others[0][0]:
                out.append(e)
    return out


def executions(steps: Sequence[Event]) -> list[tuple[float, int, int]]:
    """One (time, world, samples) per executed step (all ranks of one step, one start)."""
    groups: dict[tuple[int, int, int, int], list[Event]] = defaultdict(list)
    for e in steps:
        groups[(e["step"], e["epoch"], e["start"], e["world"])].append(e)
    out = []
    for (step, _epoch, _start, world), recs in groups.items():
        # Ranks of one execution write within a step of each other; a re-execution after a
        # rollback at the same world is told apart by a time gap.
        recs.sort(key=lambda r: r["t"])
        chunk: list[Event] = [recs[0]]
        for r in recs[1:]:
            if r["t"] - chunk[0]["t"] > 2.0 or any(c["rank"] == r["rank"] for c in chunk):
                out.append((chunk[0]["t"], world, sum(len(c["indices"]) for c in chunk)))
                chunk = [r]
            else:
                chunk.append(r)
        out.append((chunk[0]["t"], world, sum(len(c["indices"]) for c in chunk)))
    out.sort()
    return out


def steady_rate(events: Sequence[Event], t0: float, t1: float, world: int) -> float | None:
    """Samples/s at `world` between t0 and t1 (no failures in between): samples of the steps after
    the first one over the time from the first to the last step."""
    ex = [x for x in executions(step_records(events)) if t0 <= x[0] <= t1 and x[1] == world]
    if len(ex) < 3:
        return None
    span = ex[-1][0] - ex[0][0]
    return sum(x[2] for x in ex[1:]) / span if span > 0 else None


def stretch_rates(events: Sequence[Event], t0: float, t1: float, skip: int = 2, least: int = 5) -> dict[int, float]:
    """Steady samples/s per world size, pooled over the stretches of consecutive steps at one size
    between t0 and t1 (the first `skip` steps after a change left out, at least `least` kept): all
    their samples over all their time. A check on the calibration, not a part of the ideal."""
    ex = [x for x in executions(step_records(events)) if t0 <= x[0] <= t1]
    samples: dict[int, int] = defaultdict(int)
    seconds: dict[int, float] = defaultdict(float)
    i = 0
    while i < len(ex):
        j = i
        while j < len(ex) and ex[j][1] == ex[i][1]:
            j += 1
        run = ex[i + skip:j]
        if len(run) >= least and run[-1][0] > run[0][0]:
            samples[ex[i][1]] += sum(x[2] for x in run[1:])
            seconds[ex[i][1]] += run[-1][0] - run[0][0]
        i = j
    return {n: samples[n] / seconds[n] for n in samples}


@dataclass
class ChangeFigures:
    t: float  # replay seconds
    before: int
    after: int
    kind: str  # join | kill_notice | kill_no_notice | restart
    pause_s: float
    lost_samples: int
    first_step_s: float | None  # change -> first step at the new world size (None: none in the window)


@dataclass
class SystemFigures:
    committed_samples: float  # a whole number for one replay; `pool`: the mean per replay
    lost_samples: float
    ideal_samples: float
    goodput_vs_ideal: float
    pause_s: list[float]
    idle_s: float
    duplicates: int
    skipped: int
    completed_epochs: int
    changes: list[ChangeFigures] = field(default_factory=list)
    series: dict[str, list[Any]] = field(default_factory=dict)  # for the plot
    repeats: list[dict[str, Any]] = field(default_factory=list)  # each replay's headline figures (`pool`)

    def headline(self) -> dict[str, Any]:
        return {"committed_samples": round(self.committed_samples, 1), "lost_samples": round(self.lost_samples, 1),
                "goodput_vs_ideal": round(self.goodput_vs_ideal, 4), "pause_s": [round(p, 2) for p in self.pause_s]}

    def to_json(self) -> dict[str, Any]:
        return {
            **({"repeats": self.repeats} if self.repeats else {}),
            "committed_samples": self.committed_samples, "lost_samples": self.lost_samples,
            "ideal_samples": round(self.ideal_samples, 1), "goodput_vs_ideal": round(self.goodput_vs_ideal, 4),
            "pause_s": [round(p, 2) for p in self.pause_s], "idle_s": round(self.idle_s, 2),
            "duplicates": self.duplicates, "skipped": self.skipped, "completed_epochs": self.completed_epochs,
            "changes": [{**c.__dict__, "pause_s": round(c.pause_s, 2),
                         "first_step_s": None if c.first_step_s is None else round(c.first_step_s, 2)}
                        for c in self.changes],
        }


def pool(figs: Sequence[SystemFigures]) -> SystemFigures:
    """One system's figures over several replays of the same window (`--repeats`): samples and
    idle time are the means per replay, goodput is the pooled committed over the pooled ideal, and
    the changes (pauses, lost work, first steps) are every replay's, in order, for the per-event
    costs. Duplicates and skips come from the last replay, whose coverage check spans the whole
    history. One replay on a noisy host says little: on 2 cores the same world's 10 s spans of
    one calibration read 24.7 to 37.1 samples/s."""
    if len(figs) == 1:
        return figs[0]
    n = len(figs)
    last = figs[-1]
    changes = [c for f in figs for c in f.changes]
    committed = sum(f.committed_samples for f in figs)
    ideal = sum(f.ideal_samples for f in figs)
    return SystemFigures(
        committed_samples=round(committed / n, 1), lost_samples=round(sum(f.lost_samples for f in figs) / n, 1),
        ideal_samples=ideal / n, goodput_vs_ideal=committed / ideal if ideal > 0 else 0.0,
        pause_s=[c.pause_s for c in changes], idle_s=sum(f.idle_s for f in figs) / n, duplicates=last.duplicates,
        skipped=last.skipped, completed_epochs=last.completed_epochs, changes=changes, series=figs[0].series,
        repeats=[f.headline() for f in figs])


def ideal_samples(tl: ReplayTimeline, rates: dict[int, float]) -> float:
    """The ideal: at every instant the best steady-state rate that instant's nodes can give, no
    cost for changing it."""
    return sum((s.t1 - s.t0) * best_rate(rates, s.nodes) for s in tl.segments())


def best_rate(rates: dict[int, float], nodes: int) -> float:
    """The best steady-state rate with `nodes` available: that of any count up to it. Where more
    nodes train slower (a simulated Horovod world of 4 beside 3 on a 2-core VM: 40.3-42.2 against
    53.8-57.7 samples/s), the ideal leaves the extra ones idle rather than ask less of a system."""
    return max((r for n, r in rates.items() if n <= nodes), default=0.0)


def coverage_faults(events: Sequence[Event], num_samples: int,
                    until: float = float("inf")) -> tuple[int, int, int]:
    """(duplicates, skipped, completed epochs) over the committed history's completed epochs, up
    to `until`: what workers record while the runner stops the cluster is no part of it (seen: a
    step at world 4 that three ranks recorded but never completed as the stop began, redone by the
    world of 2 that formed during the stop: both counted, 36 duplicates, when the redo's resume
    was left out and its steps were not)."""
    cov: dict[int, list[int]] = defaultdict(list)
    for r in committed_records(events, until):
        if r["t"] <= until:
            cov[r["epoch"]].extend(r["indices"])
    if not cov:
        return 0, 0, 0
    last = max(cov)
    dup = skip = done = 0
    for epoch, idx in cov.items():
        distinct = set(idx)
        if epoch == last and len(distinct) < num_samples:
            continue  # the epoch still in progress when the replay ended
        done += 1
        dup += len(idx) - len(distinct)
        skip += num_samples - len(distinct & set(range(num_samples)))
    return dup, skip, done


def measure(events: Sequence[Event], *, t_start: float, tl: ReplayTimeline, rates: dict[int, float],
            num_samples: int, change_kinds: Sequence[str], change_delays: Sequence[float],
            until: float = float("inf")) -> SystemFigures:
    """Figures for one system's replay that began at wall time `t_start`.

    change_kinds[i]: what change i did; change_delays[i]: seconds from change i to the moment its
    node actually died (the notice time for a kill with notice), which lost work is attributed to."""
    t_end = t_start + tl.duration_s
    steps = step_records(events)
    final_ids = {id(r) for r in committed_records(events, until)}
    in_window = [e for e in steps if t_start <= e["t"] < t_end]
    committed = sum(len(e["indices"]) for e in in_window if id(e) in final_ids)
    done_total = sum(len(e["indices"]) for e in in_window)
    ex = [x for x in executions(steps) if t_start <= x[0] < t_end]
    times = [x[0] for x in ex]
    gaps = [b - a for a, b in zip(times, times[1:])]
    typical = statistics.median(gaps) if gaps else 0.0
    idle = sum(g - typical for g in gaps if g > 3 * typical)
    if times:
        idle += max(0.0, times[0] - t_start - typical) + max(0.0, t_end - times[-1] - typical)
    else:
        idle = tl.duration_s

    changes: list[ChangeFigures] = []
    wall = [t_start + c.t for c in tl.changes]
    lost_by_change = [0] * len(tl.changes)
    for e in in_window:
        if id(e) in final_ids or not tl.changes:
            continue
        # Work thrown away belongs to the first change whose node died at or after it ran.
        i = next((k for k, w in enumerate(wall) if w + change_delays[k] + 1.0 >= e["t"]), len(wall) - 1)
        lost_by_change[i] += len(e["indices"])
    all_ex = executions(steps)
    all_times = [x[0] for x in all_ex]
    for i, c in enumerate(tl.changes):
        lo = wall[i]
        # A pause ends at the next step, or at the next change (which then owns the rest); the last
        # change's pause may run past the window (the runner keeps going until training resumes),
        # but not past `until`: the runner's own stopping of the cluster is no change's pause.
        hi = wall[i + 1] if i + 1 < len(wall) else until
        bounded = [t_start] + [t for t in all_times if t_start <= t <= until]
        if i + 1 == len(wall) and (not bounded or bounded[-1] <= lo):
            bounded.append(t_end)
        # Only the part after this change is its pause (an earlier change owns what came before).
        candidates = [(min(b, hi) - max(a, lo)) + (min(typical, lo - a) if a < lo else 0.0)
                      for a, b in zip(bounded, bounded[1:]) if b > lo and a < hi]
        pause = max(0.0, max(candidates, default=min(hi, t_end) - lo) - typical)
        first = next((t for t, w, _ in all_ex if t > lo and w == c.after), None)
        changes.append(ChangeFigures(c.t, c.before, c.after, change_kinds[i], pause, lost_by_change[i],
                                     None if first is None or first > hi else first - lo))
    ideal = ideal_samples(tl, rates)
    dup, skip, done = coverage_faults(events, num_samples, until)
    # Per-second series for the plot: committed samples/s and the world size seen in steps.
    series: dict[str, list[Any]] = {"t": [], "samples_per_s": [], "world_t": [], "world": []}
    buckets: dict[int, int] = defaultdict(int)
    for e in in_window:
        if id(e) in final_ids:
            buckets[int(e["t"] - t_start)] += len(e["indices"])
    for sec in range(int(tl.duration_s) + 1):
        series["t"].append(sec)
        series["samples_per_s"].append(buckets.get(sec, 0))
    for t, world, _ in ex:
        series["world_t"].append(round(t - t_start, 3))
        series["world"].append(world)
    return SystemFigures(
        committed_samples=committed, lost_samples=done_total - committed, ideal_samples=ideal,
        goodput_vs_ideal=committed / ideal if ideal > 0 else 0.0, pause_s=[c.pause_s for c in changes],
        idle_s=idle, duplicates=dup, skipped=skip, completed_epochs=done, changes=changes, series=series,
    )
