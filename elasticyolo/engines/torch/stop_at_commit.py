"""A torch-elastic round ends at a commit, not in the middle of a step (worker side).

torch's agent ends a round by sending its workers SIGTERM: when a node joins (its monitor sees a
waiting node), and on the leaving node when a spot notice stops its launcher. A worker that exits
at once throws away the step in flight on every rank (the next round resumes from the last
commit's snapshot): half a step of the whole world's work per change on average, and a peer
that only sees the exit through a failed collective. Seen in a replay (2-core host, world 2-3,
1.6-2.8 s steps): 1-2.7 s without a committed step around each change.

Here SIGTERM only *asks* for a stop. The request rides on every step's gradient all-reduce (one
more element: `outgoing`/`incoming`), so the step after it the world knows and commits there
(`commit_now`), not at its next regular commit: those come every ~2 s of work, and a joining node
waited 0-2.2 s (seen in a replay) for the running world to reach one. At every commit the ranks
all-reduce the request again (one integer); if any rank asked, every rank stops right there, once
the commit's snapshot is on disk: the next round resumes from exactly the step this one ended at,
and the running world lost nothing but the time to re-form. The ranks agree after the commit's
snapshot and before rank 0's checkpoint (`agree`), the stop comes last (`check`): agreeing after
rank 0's checkpoint copy held every peer at the all-reduce for that copy (0.3-0.5 s on a replay
node), and a node leaving on a spot notice is SIGKILLed about 1 s after it (its drain's deadline):
in a replay the leaving rank died waiting there, and the survivors saw the stop as a crash 1.3 s
later. Agreeing before the snapshot lost it when a peer died in that all-reduce (a SIGKILLed node
in a clean-clone run: the survivor resumed two steps back). A rank that does not reach a commit
within `wait_s` of its SIGTERM (a peer died and the collective hangs, a long step), or
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
from elasticyolo.worker_runtime.commit import EngineCommit

if TYPE_CHECKING:
    import torch

    from elasticyolo.train.core import TrainCore
    from elasticyolo.train.snapshots import LocalSnapshots

log = get_logger("elasticyolo.torch.stop")

# How long a SIGTERMed worker trains on towards a commit. Short, since a node drained on a spot
# notice has seconds (its launcher is SIGKILLed `drain.kill_lead_s` before the deadline:
# `torch/node.py`), and a worker that misses the commit must still finish its snapshot before
# that; long enough for a commit interval (`worker_runtime/commit.py` aims at 2 s of work between commits).
STOP_WAIT_S = 2.5
# A rank already waiting at the commit for its peers' answer gets this much longer (seen: rank 0
# 1 s behind its peers, when its checkpoint copy still came first). Bounded, since the peer may be
# frozen: a clean-clone run waited 31 s on a SIGSTOPped node's collective without a bound.
AT_COMMIT_GRACE_S = 1.0
EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_PEER_STOPPED = 75  # EX_TEMPFAIL: a peer is leaving this round; restart it


class StopAtCommit(EngineCommit):
    """The torch worker's `EngineCommit` (worker_runtime/commit.py): `request()` from the SIGTERM
    watcher, `agree()` then `check()` at every commit on every rank. `reduce(flag) -> sum over ranks`."""

    def __init__(self, core: "TrainCore", reduce: Any, snapshots: "LocalSnapshots",
                 wait_s: float = STOP_WAIT_S, exit: Any = os._exit, world: int = 1) -> None:
        self.core, self.reduce, self.snapshots, self.wait_s, self._exit = core, reduce, snapshots, wait_s, exit
        self.world = world
        self._agreed = False  # a step's all-reduce carried a request: commit (and stop) now
        self._in_flight: tuple[Any, Any] | None = None  # (pinned flag, CUDA event) of the last step
        self.requested = threading.Event()
        self.at_commit = threading.Event()  # the main thread waits for the ranks' answer
        self.stopping = threading.Event()  # the ranks agreed: the main thread stops at this commit
        self._asked = False  # this rank asked (its exit code says so)

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

    # ---- the request on the step's gradient all-reduce (`worker.make_allreduce`) ----
    def outgoing(self, like: "torch.Tensor") -> "torch.Tensor":
        """This rank's flag for the step's gradient all-reduce: one element of `like`'s kind."""
        return like.new_full((1,), 1.0 if self.requested.is_set() else 0.0)

    def incoming(self, summed: "torch.Tensor") -> None:
        """The flag summed over the ranks, right after the all-reduce."""
        if not summed.is_cuda:
            self._agreed = float(summed[0]) > 0
            return
        # No host sync on a GPU: copied off the stream and read after the next step (every rank
        # has a GPU, so every rank decides at the same step).
        import torch

        host = torch.empty(1, dtype=summed.dtype, pin_memory=True)
        host.copy_(summed.detach().reshape(1), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        if self._in_flight is not None:
            prev, prev_done = self._in_flight
            prev_done.synchronize()
            self._agreed = self._agreed or float(prev[0]) > 0
        self._in_flight = (host, done)

    def commit_now(self) -> bool:
        """After a step: the world agreed to commit here (a rank asked for a stop). Without a
        gradient all-reduce (a world of one) the request is this rank's own."""
        return self._agreed or (self.world == 1 and self.requested.is_set())

    def save(self) -> None:
        return None

    def agree(self) -> None:
        """In a commit after the local snapshot, before rank 0's checkpoint copy
        (`worker_runtime/commit.py`): the ranks agree whether it ends the round."""
        asked = self.requested.is_set()
        self.at_commit.set()
        try:
            if self.reduce(1 if asked else 0) == 0:
                return
            self._asked = asked
            self.stopping.set()
        finally:
            self.at_commit.clear()
        log.info("stopping at a commit", asked_here=asked)

    def check(self) -> None:
        """Last in a commit: stop here if the ranks agreed to."""
        if not self.stopping.is_set():
            return
        # The next round resumes from this commit's snapshot: on disk before this process goes
        # (a snapshot period may have skipped it at this commit).
        if self.snapshots.submitted_step != self.core.progress.step:
            self.snapshots.save_now(self.core, 5.0)
        self.snapshots.flush(5.0)
        sys.stdout.flush()
        sys.stderr.flush()
        self._exit(EXIT_SIGTERM if self._asked else EXIT_PEER_STOPPED)


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
