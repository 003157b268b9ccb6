"""Young/Daly checkpoint interval: T = sqrt(2 * C * MTBF).

C is the cost of one checkpoint to training: the blocking snapshot time plus a share of the
background upload (it competes for CPU, GIL and network). MTBF is the mean time between events
that lose the in-memory state (with elastic training that is losing *every* worker, not one node:
feed `observe_preemption()` accordingly). With few observations, the prior MTBF dominates.
"""

from __future__ import annotations

import math
import time
from typing import Callable


class YoungDaly:
    def __init__(self, *, mtbf_prior_s: float = 3600.0, prior_weight: float = 1.0, min_s: float = 30.0,
                 max_s: float = 3600.0, upload_share: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.mtbf_prior_s = mtbf_prior_s
        self.prior_weight = prior_weight
        self.min_s, self.max_s = min_s, max_s
        self.upload_share = upload_share
        self._clock = clock
        self._start = clock()
        self._events = 0
        self._cost: float | None = None
        self._upload: float | None = None

    def observe_cost(self, snapshot_s: float, upload_s: float, alpha: float = 0.3) -> None:
        cost = snapshot_s + self.upload_share * upload_s
        self._cost = cost if self._cost is None else (1 - alpha) * self._cost + alpha * cost
        self._upload = upload_s if self._upload is None else (1 - alpha) * self._upload + alpha * upload_s

    def observe_preemption(self, count: int = 1) -> None:
        self._events += count

    def mtbf_s(self) -> float:
        exposure = self._clock() - self._start
        return (self.prior_weight * self.mtbf_prior_s + exposure) / (self.prior_weight + self._events)

    def interval_s(self) -> float:
        """Until a cost has been measured, the minimum (take a first checkpoint early)."""
        if self._cost is None:
            return self.min_s
        t = math.sqrt(2.0 * self._cost * self.mtbf_s())
        t = max(t, self._upload or 0.0)  # never faster than uploads can land
        return min(max(t, self.min_s), self.max_s)
