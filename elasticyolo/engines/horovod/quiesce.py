"""Worker side of a drain (see drain.py): quiesce at a commit boundary, report resumes.

`QuiescePoller` reads the job's `quiesce` key a few times a second in a thread (rank 0's copy is
the one that counts: it travels to every rank in the broadcast Horovod already makes at each
commit, so all ranks act on the same commit). `quiesce()` then runs on every rank: node-local
snapshot of the committed state, optional store checkpoint (rank 0), one all-reduce so every
node's snapshot is on disk, and rank 0's acknowledgement with the step.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from elasticyolo.engines import worker_env as env_client
from elasticyolo.cluster.etcd import EtcdClient, EtcdError
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.engines.horovod.drain import quiesce_ack_key, quiesce_key, read_json, resume_key
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.worker.drain")
POLL_S = 0.25
# Workers that quiesced for a handover wait this long to be stopped by their agent, then exit.
HOLD_MAX_S = 300.0


class QuiesceInterrupt(Exception):
    """All ranks stopped at a commit for a handover; the process waits to be stopped."""

    def __init__(self, request: dict[str, Any]) -> None:
        super().__init__(f"quiesced for {request.get('by')}")
        self.request = request


def client_from_env() -> tuple[EtcdClient, JobKeys] | None:
    return env_client.client_from_env(timeout=1.0)


class QuiescePoller:
    def __init__(self) -> None:
        self.conn = client_from_env()
        self.term = os.environ.get("ELASTICYOLO_DRIVER_TERM")
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
                req = read_json(client, quiesce_key(keys))
            except (UnavailableError, EtcdError):
                continue
            # A request names the driver term it is for (None: any); a new world never acts on
            # its predecessor's request.
            if req is not None and req.get("term") is not None and str(req.get("term")) != self.term:
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
                client.put(quiesce_ack_key(keys), json.dumps(rec))
                return
            except (UnavailableError, EtcdError) as exc:
                log.warning("could not acknowledge the quiesce; retrying", error=str(exc))
                time.sleep(0.2)

    def last_ack(self) -> dict[str, Any] | None:
        if self.conn is None:
            return None
        try:
            return read_json(self.conn[0], quiesce_ack_key(self.conn[1]))
        except (UnavailableError, EtcdError):
            return None

    def report_resume(self, step: int, world: int, lost_steps: int | None, reason: str) -> None:
        """Rank 0: one record per (re)start of training, for the draining agent and `status`."""
        if self.conn is None:
            return
        client, keys = self.conn
        rec = {"step": step, "world": world, "lost_steps": lost_steps, "reason": reason, "term": self.term,
               "at": time.time()}
        try:
            client.put(resume_key(keys), json.dumps(rec))
        except (UnavailableError, EtcdError) as exc:
            log.warning("could not publish the resume record", error=str(exc))


def hold_until_stopped(seconds: float = HOLD_MAX_S) -> None:
    """A quiesced worker waits for its agent's SIGTERM (exiting 0 would read as 'job done')."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.5)
