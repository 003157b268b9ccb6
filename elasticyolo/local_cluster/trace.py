"""Read the workers' JSONL traces (see `elasticyolo.train.loop.TraceWriter`) for tests and benches."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from elasticyolo.chaos.measure import committed_records


def read_trace(directory: str | Path) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    for f in Path(directory).glob("trace-*.jsonl"):
        for line in f.read_text().splitlines():
            if line.strip():
                try:
                    events.append(json.loads(line))
                except ValueError:
                    pass  # a line cut short by SIGKILL
    events.sort(key=lambda e: e["t"])
    return events


class TraceEvents:
    """A scenario's view of its workers' trace directory, read afresh at every call."""

    def __init__(self, trace_dir: Path) -> None:
        self.trace_dir = trace_dir

    def events(self, ev: str | None = None, **match: Any) -> list[dict[str, Any]]:
        """The events named `ev` (all where None) whose fields equal `match`, in time order."""
        out = read_trace(self.trace_dir) if self.trace_dir.exists() else []
        return [e for e in out if (ev is None or e["ev"] == ev) and all(e.get(k) == v for k, v in match.items())]

    def steps_after(self, t: float, world: int) -> list[dict[str, Any]]:
        return [e for e in self.events("step", world=world) if e["t"] > t]

    def worker_pids(self, node: str) -> set[int]:
        """Every worker process that trained on `node`."""
        return {e["pid"] for e in self.events("resume", node=node)}


def final_step_records(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The step records that make up the committed history: steps no later resume rolled back
    (chaos/measure.py's rule: a world that restored an older state redoes that work, maybe at
    another world size and so under other step numbers), and for each step number the latest
    execution (grouped by epoch, start position and world size), one record per rank."""
    by_step: dict[int, dict[tuple[int, int, int], list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for e in committed_records(events):
        by_step[e["step"]][(e["epoch"], e["start"], e["world"])].append(e)
    out: list[dict[str, Any]] = []
    for step in sorted(by_step):
        groups = by_step[step]
        latest = max(groups.values(), key=lambda recs: max(r["t"] for r in recs))
        per_rank: dict[int, dict[str, Any]] = {}
        for r in sorted(latest, key=lambda r: r["t"]):
            per_rank[r["rank"]] = r
        out.extend(per_rank.values())
    return out


def coverage_by_epoch(events: list[dict[str, Any]]) -> dict[int, list[int]]:
    """Sample indices trained per epoch, counting only committed (final) work."""
    cov: dict[int, list[int]] = defaultdict(list)
    for r in final_step_records(events):
        cov[r["epoch"]].extend(r["indices"])
    return dict(cov)


def pids_by_rank(events: list[dict[str, Any]]) -> dict[int, int]:
    """The live mapping rank -> worker pid, from the latest resume of each pid."""
    latest: dict[int, dict[str, Any]] = {}
    for e in events:
        if e["ev"] == "resume":
            latest[e["pid"]] = e
    out: dict[int, int] = {}
    for pid, e in sorted(latest.items(), key=lambda kv: kv[1]["t"]):
        out[e["rank"]] = pid
    return out


def assert_each_epoch_exactly_once(events: list[dict[str, Any]], epochs: int, num_samples: int) -> None:
    """Every epoch trained every sample index exactly once, counting only committed work."""
    cov = coverage_by_epoch(events)
    assert sorted(cov) == list(range(epochs)), f"epochs trained: {sorted(cov)}"
    for epoch, indices in cov.items():
        assert sorted(indices) == list(range(num_samples)), f"epoch {epoch}: duplicates or gaps"
