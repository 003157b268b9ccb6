"""What a commit is, for every engine (worker side): the hooks `train.loop.TrainingLoop` calls.

A commit, in this order:
1. `EngineCommit.save()` - the engine makes the state its rollback point (Horovod:
   `state.save()`; torch: a copy in host memory);
2. the node-local snapshot (local rank 0; `train/snapshots.py`), at most every `period_s`;
3. `EngineCommit.agree()` - a collective the engine needs before rank 0's checkpoint copy can
   hold its peers (torch: whether a newer world is out or a rank leaves); after the snapshot, so that a peer
   dying in it costs no node its snapshot of this commit;
4. the store checkpoint when one is due (rank 0; `train/checkpointing.py`);
5. `EngineCommit.check()` - the engine may now interrupt (Horovod raises a hosts-updated reset
   here, the torch worker leaves its world if the ranks agreed to; 1, 2 and 4 hold exactly the committed
   state).

Every rank commits at the same steps (the loop's contract): rank 0 measures about
`target_s` seconds of work per interval, unless the spec fixes `commit_every`, and broadcasts it.
"""

from __future__ import annotations

import time
from typing import Any

from elasticyolo.train.checkpointing import Checkpointer
from elasticyolo.train.collectives import Collectives
from elasticyolo.train.core import TrainCore
from elasticyolo.train.loop import Hooks
from elasticyolo.train.snapshots import LocalSnapshots


class EngineCommit:
    """An engine's part of a commit. Every part has a default (nothing to do): an engine that
    restarts its world on any change and needs no agreement implements none of them."""

    def save(self) -> None:
        """Make the state the engine's rollback point."""
        return None

    def agree(self) -> None:
        """A collective the engine needs before rank 0's checkpoint copy can hold its peers."""
        return None

    def check(self) -> None:
        """The engine may now interrupt (a reset, an agreed stop)."""
        return None

    def commit_now(self) -> bool:
        """Asked after every step: the world agreed to commit at this step outside the interval
        (the torch engine: a newer world is out or a rank asked to leave). The same answer on
        every rank."""
        return False


class CommitHooks(Hooks):
    def __init__(self, core: TrainCore, collectives: Collectives, *, target_s: float,
                 snapshots: LocalSnapshots | None = None, checkpointer: Checkpointer | None = None,
                 engine: EngineCommit | None = None) -> None:
        self.core, self.collectives, self.target_s = core, collectives, target_s
        self.snapshots, self.checkpointer = snapshots, checkpointer
        self.engine = engine or EngineCommit()
        self._fixed = core.spec.commit_every
        self._t_last = time.perf_counter()
        self._step_last = core.progress.step

    def commit(self) -> None:
        self.engine.save()
        if self.snapshots is not None:
            self.snapshots.maybe_save(self.core)
        self.engine.agree()
        if self.checkpointer is not None:
            self.checkpointer.after_commit(self.core)
        self.engine.check()

    def commit_now(self) -> bool:
        return self.engine.commit_now()

    def gather(self, obj: Any) -> list[Any]:  # type: ignore[override]  # a method: every rank validates its share
        """All-gather for sharded validation (see `TrainCore.validate`)."""
        return self.collectives.allgather_object(obj)

    def commit_every(self, core: TrainCore) -> int:
        if self._fixed:
            return self._fixed
        now, step = time.perf_counter(), core.progress.step
        done = step - self._step_last
        per_step = (now - self._t_last) / done if done > 0 else 0.0
        self._t_last, self._step_last = now, step
        n = max(1, round(self.target_s / per_step)) if per_step > 0 else 1
        return int(self.collectives.broadcast_object(n, 0))
