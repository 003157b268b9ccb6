"""Spot-capacity traces: `time_ms,node_count` rows (no header), one row per join or preemption.

Parsing and validation only (no I/O beyond reading the file); every problem is one line naming the
file and the line (`TraceError`, a UserError)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from elasticyolo.errors import UserError


class TraceError(UserError):
    """A malformed trace or a window that does not fit it."""


@dataclass(frozen=True)
class SpotTrace:
    """Rows (time in seconds, node count), sorted by time; several rows may share a time (a burst)."""

    path: str
    rows: tuple[tuple[float, int], ...]

    @property
    def duration_s(self) -> float:
        return self.rows[-1][0]

    @property
    def max_count(self) -> int:
        return max(c for _, c in self.rows)

    def count_at(self, t_s: float) -> int:
        """Node count in effect at time t (the last row at or before t)."""
        count = self.rows[0][1]
        for t, c in self.rows:
            if t > t_s:
                break
            count = c
        return count

    def change_times(self) -> list[tuple[float, int]]:
        """(time, count after every row at that time): bursts collapsed into one change."""
        out: list[tuple[float, int]] = []
        for t, c in self.rows:
            if out and out[-1][0] == t:
                out[-1] = (t, c)
            else:
                out.append((t, c))
        return out


def parse_trace(text: str, path: str = "<trace>") -> SpotTrace:
    rows: list[tuple[float, int]] = []
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = [f.strip() for f in line.split(",")]
        where = f"trace {path} line {lineno}"
        if len(fields) != 2:
            raise TraceError(f"{where}: expected 2 columns time_ms,node_count, got {len(fields)} ({line!r})")
        try:
            t_ms = float(fields[0])
        except ValueError:
            raise TraceError(f"{where}: time_ms {fields[0]!r} is not a number") from None
        try:
            count = int(fields[1])
        except ValueError:
            raise TraceError(f"{where}: node_count {fields[1]!r} is not an integer") from None
        if not math.isfinite(t_ms) or t_ms < 0:
            raise TraceError(f"{where}: time_ms {fields[0]} must be a finite number >= 0")
        if count < 0:
            raise TraceError(f"{where}: node_count {count} is negative")
        if rows and t_ms / 1000.0 < rows[-1][0]:
            raise TraceError(f"{where}: time {fields[0]} ms is before the previous row's "
                             f"{rows[-1][0] * 1000:.0f} ms (rows must be sorted by time)")
        rows.append((t_ms / 1000.0, count))
    if not rows:
        raise TraceError(f"trace {path}: no rows (expected time_ms,node_count lines)")
    if max(c for _, c in rows) == 0:
        raise TraceError(f"trace {path}: every node_count is 0")
    return SpotTrace(path, tuple(rows))


def load_trace(path: str | Path) -> SpotTrace:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise TraceError(f"trace {p}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"trace {p}: cannot read ({exc})") from None
    return parse_trace(text, str(p))


@dataclass(frozen=True)
class Window:
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def check_window(trace: SpotTrace, start_hour: float, hours: float) -> Window:
    """[start_hour, start_hour + hours) in trace time; one-line error if it does not fit."""
    end_hour = trace.duration_s / 3600.0
    if not math.isfinite(start_hour) or not math.isfinite(hours) or hours <= 0:
        raise TraceError(f"window --start-hour {start_hour} --hours {hours}: --hours must be > 0")
    if start_hour < 0 or start_hour + hours > end_hour + 1e-9:
        raise TraceError(f"window [{start_hour:g}, {start_hour + hours:g}) h is outside trace {trace.path} "
                         f"(0 to {end_hour:.2f} h)")
    return Window(start_hour * 3600.0, (start_hour + hours) * 3600.0)
