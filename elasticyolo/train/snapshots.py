"""Node-local snapshots of the committed training state, used by every engine.

Format: one file per node, `<worker dir>/snapshots/state.pt`, holding a `train.state.core_state`
dict (versioned with `STATE_FORMAT`: model, EMA + update count, optimizer, AMP scaler, progress).
Written atomically: a temp file, fsync, rename, fsync of the directory; a torn or foreign file
reads as "no snapshot".

Writer (`LocalSnapshots`, on local rank 0 of each node): at a commit the training thread only
copies the tensors to CPU; pickling and the disk write run on a background thread. A newer state
replaces one still waiting, so at most one write is queued; `save_now` (a drain's quiesce) waits
until its state is on disk; pending writes are finished at interpreter exit, and (torch
engine) on SIGTERM before the process goes (`finish_snapshot_on_sigterm`; the torch worker first
tries to stop at its next commit, `engines/torch/worker.py`). An engine may
snapshot less often than it commits (`period_s`).

Restore (`restore_newest`): a collective over a freshly started world with the engine's
collectives passed in. Every rank offers its node's snapshot step, rank 0 adds the checkpoint
store's newest step; the newest wins, a node-local one on a tie (no download). Ranks whose node
holds it load it from disk; otherwise its holder sends it. If the store is ahead of every node,
rank 0 downloads, verifies and loads it, then sends it. Nothing anywhere: a fresh start.
"""

from __future__ import annotations

import io
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from elasticyolo.exit_hooks import at_exit
from elasticyolo.log import get_logger
from elasticyolo.train.collectives import Collectives
from elasticyolo.train.state import STATE_FORMAT, core_state, load_core_state, state_step

if TYPE_CHECKING:
    from elasticyolo.train.checkpointing import Checkpointer
    from elasticyolo.train.core import TrainCore

log = get_logger("elasticyolo.snapshots")

SNAPSHOT_FILE = "state.pt"


# ---- format ------------------------------------------------------------------------------------
def write_snapshot(state: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Atomic and durable: a crash at any point leaves the previous snapshot or this one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        torch.save(dict(state), fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself
    finally:
        os.close(dir_fd)


def read_snapshot(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The snapshot at `path`, or None when there is none or it is unreadable (torn, foreign)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001 - a corrupt local snapshot only means "fall back"
        log.warning("snapshot unreadable; ignoring it", path=str(path), error=str(exc))
        return None
    return state if isinstance(state, dict) and state.get("format") == STATE_FORMAT else None


# ---- writer ------------------------------------------------------------------------------------
class LocalSnapshots:
    """This node's snapshot file: every local rank reads it, the one with `writer=True` writes it."""

    def __init__(self, directory: str | os.PathLike[str] | None, *, writer: bool = True,
                 period_s: float = 0.0) -> None:
        self.path = Path(directory) / SNAPSHOT_FILE if directory is not None else None
        self.writer = writer and self.path is not None
        self.period_s = period_s
        self.written_step = -1
        self.submitted_step = -1  # the step of the newest state handed to the writer
        self._last_submit = float("-inf")
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._preparing = False  # the training thread is copying the state for the next snapshot
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def maybe_save(self, core: "TrainCore") -> bool:
        """At a commit: snapshot unless the last one is younger than `period_s`."""
        if not self.writer or time.monotonic() - self._last_submit < self.period_s:
            return False
        with self._cond:
            self._preparing = True  # a flush (SIGTERM) waits for this commit's snapshot too
        try:
            state = core_state(core)
        except BaseException:
            with self._cond:
                self._preparing = False
                self._cond.notify_all()
            raise
        self.submit(state)
        return True

    def save_now(self, core: "TrainCore", timeout: float | None = 60.0) -> bool:
        """Snapshot regardless of the period and wait until it is on disk (a drain's quiesce)."""
        if not self.writer:
            return True
        self.submit(core_state(core))
        return self.flush(timeout)

    def submit(self, state: dict[str, Any]) -> None:
        if not self.writer:
            return
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="local-snapshot", daemon=True)
                self._thread.start()
                at_exit(self.close)  # a worker leaving (peer died, job done) still finishes the write
            self._last_submit = time.monotonic()
            self.submitted_step = int(state.get("progress", {}).get("step", -1))
            self._pending = state
            self._preparing = False
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy and not self._preparing,
                                       timeout)

    def close(self, timeout: float | None = 60.0) -> None:
        if self._thread is None:
            return
        self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(5.0)

    def read(self) -> dict[str, Any] | None:
        return read_snapshot(self.path) if self.path is not None else None

    def _run(self) -> None:
        assert self.path is not None
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._pending is None:
                    return
                state, self._pending, self._busy = self._pending, None, True
            t0 = time.perf_counter()
            try:
                write_snapshot(state, self.path)
                self.written_step = state_step(state)
                log.debug("snapshot saved", step=self.written_step, seconds=round(time.perf_counter() - t0, 3))
            except Exception as exc:  # noqa: BLE001 - a failed snapshot must not stop training
                log.warning("local snapshot failed", path=str(self.path), error=str(exc))
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()


def finish_snapshot_on_sigterm(snapshots: "LocalSnapshots", timeout_s: float = 5.0,
                               stop_at_commit: Callable[[], bool] | None = None) -> bool:
    """On SIGTERM (torch elastic stopping this worker for its next round): wait up to `timeout_s`
    for the snapshot being written, or being copied by a commit in progress, then exit at once.
    The restarted world then resumes from the newest commit, not the one before it (seen: a round
    restarted 0.2 s after a commit, while that commit's snapshot was still being written; and a
    SIGTERM 50 ms after a commit, while its state was being copied). A thread watches the signal wakeup fd, so a main
    thread blocked in a collective delays nothing. Main thread only (False elsewhere).
    `stop_at_commit`: asked first; True means the main thread stops at a commit and exits by
    itself (`engines/torch/worker.py`), False that it did not in time."""
    if threading.current_thread() is not threading.main_thread():
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    signal.signal(signal.SIGTERM, lambda *_: None)  # a Python handler: its signal reaches the wakeup fd
    signal.set_wakeup_fd(w, warn_on_full_buffer=False)

    def watch() -> None:
        while True:
            data = os.read(r, 64)
            if signal.SIGTERM in data:
                if stop_at_commit is not None and stop_at_commit():
                    return
                snapshots.flush(timeout_s)
                os._exit(128 + signal.SIGTERM)

    threading.Thread(target=watch, name="sigterm-snapshot", daemon=True).start()
    return True


# ---- restore -----------------------------------------------------------------------------------
@dataclass
class Restored:
    source: str  # local | peer | store | fresh
    step: int
    src_rank: int = -1


def send_state(state: dict[str, Any] | None, src: int, collectives: Collectives) -> dict[str, Any]:
    data = None
    if collectives.rank == src:
        assert state is not None
        buf = io.BytesIO()
        torch.save(state, buf)
        data = buf.getvalue()
    payload = collectives.broadcast_bytes(data, src)
    if collectives.rank == src:
        assert state is not None
        return state
    return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)  # type: ignore[no-any-return]


def restore_newest(core: "TrainCore", snapshots: LocalSnapshots | None, collectives: Collectives,
                   checkpointer: "Checkpointer | None" = None) -> Restored:
    """Load the newest state anywhere in the world into `core` (every rank calls this)."""
    t0 = time.perf_counter()
    rank = collectives.rank
    local = snapshots.read() if snapshots is not None else None
    local_step = state_step(local) if local is not None else -1
    store_step = -1
    if rank == 0 and checkpointer is not None and checkpointer.enabled:
        try:
            store_step = checkpointer.latest_step()
        except Exception as exc:  # noqa: BLE001 - an unreachable store must not block a local resume
            log.warning("checkpoint store unreadable; using local state only", error=str(exc))
    gathered = collectives.allgather_object((local_step, store_step))
    steps = [int(g[0]) for g in gathered]
    store_step = int(gathered[0][1])
    best = max(steps)
    if best < 0 and store_step < 0:
        return Restored("fresh", 0)
    if best >= store_step:
        src = steps.index(best)
        if all(s == best for s in steps):
            assert local is not None
            load_core_state(core, local)
            restored = Restored("local", best, src)
        else:
            load_core_state(core, send_state(local if rank == src else None, src, collectives))
            restored = Restored("local" if steps[rank] == best else "peer", best, src)
    else:
        # The store is ahead of every node (all nodes are new, or snapshots were lost).
        state = None
        if rank == 0 and checkpointer is not None and checkpointer.restore_into(core):
            state = core_state(core)
        if not collectives.broadcast_object(state is not None, 0):
            return Restored("fresh", 0)
        state = send_state(state, 0, collectives)
        if rank != 0:
            load_core_state(core, state)
        restored = Restored("store", core.progress.step, 0)
    log.info("restored", source=restored.source, step=restored.step, from_rank=restored.src_rank,
             seconds=round(time.perf_counter() - t0, 3))
    return restored
