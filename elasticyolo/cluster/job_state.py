"""The job's lifecycle: its states (the `state` record's "state" field) and the one rule for moving
between them. Pure: no etcd here; `cluster/jobs.py:set_job_state` applies it to the stored record.

| event    | who reports it                                        | from                      | to        |
|----------|-------------------------------------------------------|---------------------------|-----------|
| SUBMIT   | `elasticyolo submit` (a new or replacing spec)        | any, or no record         | submitted |
| START    | rank 0's first (re)start record; the Horovod driver   | submitted                 | running   |
| FINISH   | the worker or driver that saw the last epoch complete | submitted, running        | done      |
| FAIL     | the Horovod driver; the leader's crash-loop watch     | submitted, running        | failed    |
| CANCEL   | `elasticyolo cancel`                                  | any, or no record         | cancelled |

Every other pair is refused: an ended job (done, failed, cancelled) only leaves its end through a
new submission or a cancel, and a job already running is not started again. A job is *active*
(agents join its world) while submitted or running.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class JobState(str, Enum):
    """A job's state; the value is what the etcd record stores."""

    SUBMITTED = "submitted"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    def __str__(self) -> str:
        return self.value

    # Hash as the value (Enum hashes the name), so a plain string read from a record is found in
    # a set of states: `"done" in ENDED_STATES`.
    __hash__ = str.__hash__

    @property
    def active(self) -> bool:
        """Agents join the job's world (submitted or running)."""
        return self in (JobState.SUBMITTED, JobState.RUNNING)

    @property
    def ended(self) -> bool:
        return not self.active

    @classmethod
    def parse(cls, value: object) -> "JobState | None":
        """The state a record's "state" field names; None for anything else (an unreadable record)."""
        try:
            return cls(value)
        except ValueError:
            return None


class JobEvent(str, Enum):
    """What happened to the job (who reports each: the module docstring's table)."""

    SUBMIT = "submit"
    START = "start"
    FINISH = "finish"
    FAIL = "fail"
    CANCEL = "cancel"


@dataclass(frozen=True)
class Refused:
    """A transition the rule does not allow: the stored state stays as it is."""

    current: JobState | None
    event: JobEvent
    reason: str


ACTIVE_STATES = frozenset(s for s in JobState if s.active)
ENDED_STATES = frozenset(s for s in JobState if s.ended)

# event -> (the states it may leave, or None for any state and no record; the state it leads to)
_TRANSITIONS: dict[JobEvent, tuple[frozenset[JobState] | None, JobState]] = {
    JobEvent.SUBMIT: (None, JobState.SUBMITTED),
    JobEvent.START: (frozenset({JobState.SUBMITTED}), JobState.RUNNING),
    JobEvent.FINISH: (ACTIVE_STATES, JobState.DONE),
    JobEvent.FAIL: (ACTIVE_STATES, JobState.FAILED),
    JobEvent.CANCEL: (None, JobState.CANCELLED),
}


def next_job_state(current: JobState | None, event: JobEvent) -> JobState | Refused:
    """The state `event` moves a job in `current` to, or why it may not. `current` None: the
    stored record is unreadable."""
    sources, target = _TRANSITIONS[event]
    if sources is None or (current is not None and current in sources):
        return target
    if current is None:
        return Refused(current, event, f"{event.value} needs a readable job state")
    if current is target:
        return Refused(current, event, f"the job is already {current.value}")
    return Refused(current, event, f"a {current.value} job cannot {event.value}")

