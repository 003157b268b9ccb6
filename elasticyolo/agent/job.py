"""The job as an agent last read it from etcd (`spec` + `state`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticyolo.cluster.job_state import ACTIVE_STATES

if TYPE_CHECKING:
    from elasticyolo.spec import TrainSpec


@dataclass(frozen=True)
class JobView:
    spec: "TrainSpec | None"
    state: str | None  # submitted/running/cancelled/done/failed, None when never submitted
    revision: tuple[int, int]  # (spec mod revision, state mod revision): changes on every edit
    error: str | None = None  # why a stored spec was rejected

    @property
    def active(self) -> bool:
        return self.spec is not None and (self.state in ACTIVE_STATES)

    @property
    def generation(self) -> int:
        """The submission: the spec key's mod revision (every submit or replace makes a new one)."""
        return self.revision[0]
