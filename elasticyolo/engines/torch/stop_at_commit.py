"""A torch-elastic round ends at a commit, not in the middle of a step (worker side).

torch's agent ends a round by sending its workers SIGTERM: when a node joins (its monitor sees a
waiting node), and on the leaving node when a spot notice stops its launcher. A worker that exits
at once throws away the step in flight on every rank (the next round resumes from the last
commit's snapshot): half a step of the whole world's work per change on average, and a peer
that only sees the exit through a failed collective. Seen in a replay (2-core host, world 2-3,
1.6-2.8 s steps): 1-2.7 s without a committed step around each change.

Here SIGTERM only *asks* for a stop. At every commit (`check`, after the commit's snapshot was
taken) the ranks all-reduce the request (one integer); if any rank asked, every rank stops right
there, once the snapshot is on disk: the next round resumes from exactly the step this one
ended at, and the running world lost nothing but the time to re-form. A rank that does not reach
a commit within `wait_s` of its SIGTERM (a peer died and the collective hangs, a long step), or
whose ranks' answer fails, stops the way it always did: the snapshot in flight finished, then at once
(`train/snapshots.finish_snapshot_on_sigterm`).

Exit codes: 143 for a rank that got SIGTERM (its own agent is stopping it), `EXIT_PEER_STOPPED`
for a rank that stopped because a peer asked: its agent sees a failed worker and restarts its
round, the path a failed collective takes today, without waiting for that failure.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from elasticyolo.log import get_logger

if TYPE_CHECKING:
    from elasticyolo.train.core import TrainCore
    from elasticyolo.train.snapshots import LocalSnapshots

log = get_logger("elasticyolo.torch.stop")

# How long a SIGTERMed worker trains on towards a commit. Short, since a node drained on a spot
# notice has seconds (its launcher is SIGKILLed `drain.kill_lead_s` before the deadline:
# `torch/node.py`), and a worker that misses the commit must still finish its snapshot before
# that; long enough for a commit interval (`engines/commit.py` aims at 2 s of work between commits).
STOP_WAIT_S = 2.5
# A rank already waiting at the commit for its peers' answer gets this much longer: rank 0's
# commit also hands a checkpoint over (seen: 1 s behind its peers). Bounded, since the peer may be
# frozen: a clean-clone run waited 31 s on a SIGSTOPped node's collective without a bound.
AT_COMMIT_GRACE_S = 1.0
EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_PEER_STOPPED = 75  # EX_TEMPFAIL: a peer is leaving this round; restart it


class StopAtCommit:
    """The torch worker's `EngineCommit` (engines/commit.py): `request()` from the SIGTERM
    watcher, `check()` at every commit on every rank. `reduce(flag) -> sum over ranks`."""

    def __init__(self, core: "TrainCore", reduce: Any, snapshots: "LocalSnapshots",
                 wait_s: float = STOP_WAIT_S, exit: Any = os._exit) -> None:
        self.core, self.reduce, self.snapshots, self.wait_s, self._exit = core, reduce, snapshots, wait_s, exit
        self.requested = threading.Event()
        self.at_commit = threading.Event()  # the main thread waits for the ranks' answer
        self.stopping = threading.Event()  # the main thread is stopping at a commit

    def request(self) -> bool:
        """SIGTERM: ask for a stop at the next commit; True if the main thread took it up (it then
        exits by itself), False if the caller must stop the old way: no commit within `wait_s`,
        or the ranks' answer failed or did not come `AT_COMMIT_GRACE_S` after that. A rank
        waiting at a commit for slower peers is not cut short at `wait_s`: seen, a rank that left
        1 s before rank 0 reached the commit failed rank 0's collective."""
        self.requested.set()
        deadline = time.monotonic() + self.wait_s
        while not self.stopping.wait(0.05):
            now = time.monotonic()
            if now > deadline and (not self.at_commit.is_set() or now > deadline + AT_COMMIT_GRACE_S):
                return False
        return True

    def save(self) -> None:
        return None

    def check(self) -> None:
        asked = self.requested.is_set()
        self.at_commit.set()
        try:
            if self.reduce(1 if asked else 0) == 0:
                return
            self.stopping.set()
        finally:
            self.at_commit.clear()
        log.info("stopping at a commit", asked_here=asked)
        # The next round resumes from this commit's snapshot: on disk before this process goes
        # (a snapshot period may have skipped it at this commit).
        if self.snapshots.submitted_step != self.core.progress.step:
            self.snapshots.save_now(self.core, 5.0)
        self.snapshots.flush(5.0)
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(EXIT_SIGTERM if asked else EXIT_PEER_STOPPED)


def torch_reduce(device: Any) -> Any:
    """Sum one integer over the default process group (world 1: itself)."""
    import torch
    import torch.distributed as dist

    def reduce(flag: int) -> int:
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flag
        dev = device if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([flag], dtype=torch.int32, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return int(t.item())

    return reduce
