"""When a job's workers crash in a loop that no retry can end (pure; stepped in
tests/test_crash_loop.py).

The rule, shared by the engines: a job fails only when EVERY worker crashed `ALL_CRASH_LIMIT` times
in a row (the same error everywhere: bad data, a bad model, a crash at the same step). The Horovod
driver sees a reset's every worker at once (`horovod/round_policy.py`). torch elastic has no such
place: each node's torch agent restarts its own workers (a restart costs a rendezvous round), so
here the counting is per node, over what each node's agent publishes (`CrashTally`), and the
leader judges (`judge`, applied by `crash_loop_watch.py`):

* a node's streak is its failed worker rounds since the job's step last went past its highest
  value (the `progress` key): training that goes further than ever before ends every streak, and
  a crash at the same step every time does not;
* a round whose worker failed before it reached any peer (`setup`: a data path missing on the
  node, a model file that does not load) is the node's own failure, whatever the others did;
* a round whose worker failed after it joined its world (`joined`: in a collective, or in
  training) may be a peer's doing: a node killed or frozen makes the survivors' collectives fail.
  Those count only while the membership (the serving nodes) stays the same: a change of
  membership ends the `joined` part of every streak;
* the job fails when every serving node's streak is at least `limit`.

Membership churn alone therefore never ends a job: each kill or join ends the streaks it could
have caused, and the training that follows ends the rest. The judge's state is in memory: a new
leader starts from the counts it first sees (it fails a job later, never sooner).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

ALL_CRASH_LIMIT = 3  # rounds in a row in which every worker crashed: the error is deterministic
RECORD_FIELD = "worker_crashes"  # the node record's field (`CrashTally.as_record`)


@dataclass(frozen=True)
class NodeCrashes:
    """A node's failed worker rounds in one submission, cumulative."""

    setup: int = 0  # its workers failed before reaching any peer
    joined: int = 0  # its workers failed after joining their world

    @classmethod
    def from_record(cls, rec: Any, generation: int) -> "NodeCrashes":
        """From a node record's `RECORD_FIELD` (none, or another submission's: no crashes)."""
        if not isinstance(rec, dict) or rec.get("generation") != generation:
            return cls()
        return cls(int(rec.get("setup") or 0), int(rec.get("joined") or 0))


class CrashTally:
    """A node's count of failed worker rounds, from its workers' error records
    (`worker_errors.record`): the records of one round (every slot's, with the same `round` key)
    count once; a record without a key (a warm worker before its round) counts alone."""

    def __init__(self) -> None:
        self.generation: int | None = None
        self._rounds: dict[str, bool] = {}  # round key -> joined

    def add(self, rec: Mapping[str, Any]) -> bool:
        """Count one error record; True if a count changed."""
        generation = rec.get("generation")
        if generation != self.generation:
            self.generation, self._rounds = generation, {}
        key = str(rec.get("round") or f"pid:{rec.get('pid')}:{rec.get('at')}")
        if key in self._rounds:
            return False
        self._rounds[key] = rec.get("joined") is not False  # unknown: it may have reached a peer
        return True

    def counts(self) -> NodeCrashes:
        joined = sum(self._rounds.values())
        return NodeCrashes(setup=len(self._rounds) - joined, joined=joined)

    def as_record(self) -> dict[str, Any] | None:
        if self.generation is None:
            return None
        c = self.counts()
        return {"generation": self.generation, "setup": c.setup, "joined": c.joined}


@dataclass
class CrashLoopState:
    """What the judge carries between checks (one submission)."""

    generation: int | None = None
    high_step: int | None = None  # the highest step seen
    members: frozenset[str] = frozenset()
    base: dict[str, NodeCrashes] = field(default_factory=dict)  # each node's counts when its streak began


@dataclass(frozen=True)
class CrashLoopVerdict:
    fail: bool
    streaks: dict[str, int]
    reason: str | None = None


def streak(now: NodeCrashes, base: NodeCrashes) -> int:
    return max(0, now.setup - base.setup) + max(0, now.joined - base.joined)


def judge(state: CrashLoopState, generation: int, serving: Mapping[str, NodeCrashes], step: int | None,
          *, limit: int = ALL_CRASH_LIMIT) -> CrashLoopVerdict:
    """`serving`: every node serving submission `generation`, with its counts; `step`: the job's
    newest published step (None: none yet). Updates `state`."""
    if state.generation != generation:
        state.generation, state.high_step, state.members, state.base = generation, None, frozenset(), {}
    if step is not None and (state.high_step is None or step > state.high_step):
        if state.high_step is not None:  # trained further than ever: every streak ends
            state.base = dict(serving)
        state.high_step = step
    members = frozenset(serving)
    if members != state.members:  # churn: the failures in a world may be a peer's doing
        state.base = {n: NodeCrashes(state.base[n].setup, serving[n].joined) if n in state.base else serving[n]
                      for n in members}
        state.members = members
    streaks = {n: streak(serving[n], state.base[n]) for n in sorted(members)}
    if streaks and min(streaks.values()) >= limit:
        where = "before the first step" if state.high_step is None else f"without passing step {state.high_step}"
        return CrashLoopVerdict(True, streaks, f"every worker crashed {min(streaks.values())} times in a row {where}")
    return CrashLoopVerdict(False, streaks)
