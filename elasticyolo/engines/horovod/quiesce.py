"""Worker side of a handover drain (agent side: `engines/drain.py`): quiesce at a commit.

`QuiescePoller` reads the job's `quiesce` key a few times a second in a thread (rank 0's copy is
the one that counts: it travels to every rank in the broadcast Horovod already makes at each
commit, so all ranks act on the same commit). The worker then, on every rank: node-local
snapshot of the committed state, optional store checkpoint (rank 0), one all-reduce so every
node's snapshot is on disk, and rank 0's acknowledgement (`quiesce_ack`) with the step.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from elasticyolo.cluster.etcd import EtcdError
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger
from elasticyolo.worker_runtime import worker_env

log = get_logger("elasticyolo.worker.quiesce")
POLL_S = 0.25
# Workers that quiesced for a handover wait this long to be stopped by their agent, then exit.
HOLD_MAX_S = 300.0


class QuiesceInterrupt(Exception):
    """All ranks stopped at a commit for a handover; the process waits to be stopped."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__(f"quiesced for {request.get('by')}")
        self.request = request


class QuiescePoller:
    def __init__(self) -> None:
        env = worker_env.read()
        self.conn = env.etcd_client(timeout=1.0)
        self.term = env.term
        self.handled: set[str] = set()
        self._latest: dict[str, Any] | None = None
        self._stop = threading.Event()
        if self.conn is not None:
            threading.Thread(target=self._run, name="quiesce-poll", daemon=True).start()

    def _run(self) -> None:
        assert self.conn is not None
        client, keys = self.conn
        while not self._stop.wait(POLL_S):
            try:
                req = client.get_json(keys.quiesce)
            except (UnavailableError, EtcdError):
                continue
            # A request names the driver term it is for (None: any); a new world never acts on
            # its predecessor's request.
            if req is not None and req.get("term") is not None and str(req.get("term")) != str(self.term):
                req = None
            self._latest = req

    def pending(self) -> dict[str, Any] | None:
        req = self._latest
        return req if req is not None and req.get("id") not in self.handled else None

    def ack(self, request: dict[str, Any], step: int, epoch: int, checkpoint: bool | None) -> None:
        if self.conn is None:
            return
        client, keys = self.conn
        rec = {"id": request.get("id"), "step": step, "epoch": epoch, "checkpoint": checkpoint, "at": time.time()}
        for _ in range(10):
            try:
                client.put(keys.quiesce_ack, json.dumps(rec))
                return
            except (UnavailableError, EtcdError) as exc:
                log.warning("could not acknowledge the quiesce; retrying", error=str(exc))
                time.sleep(0.2)

    def last_ack(self) -> dict[str, Any] | None:
        if self.conn is None:
            return None
        try:
            return self.conn[0].get_json(self.conn[1].quiesce_ack)
        except (UnavailableError, EtcdError):
            return None


def hold_until_stopped(seconds: float = HOLD_MAX_S) -> None:
    """A quiesced worker waits for its agent's SIGTERM (exiting 0 would read as 'job done')."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
