"""Rank 0 publishes training progress to etcd (`JobKeys.progress`) for `elasticyolo status`.

A sink of the training loop (one record per step). Writes are rate-limited (at most `rate`
per second) and done by a background thread, so a slow or unreachable etcd never stalls a
step; the latest record wins. Connection settings come from the environment the agent set
(`ELASTICYOLO_ETCD`, `ELASTICYOLO_JOB`, TLS/auth `ELASTICYOLO_ETCD_*`): never the command line.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from typing import Any

from elasticyolo.engines.worker_env import client_from_env
from elasticyolo.cluster.etcd import EtcdClient, EtcdError
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.errors import UnavailableError

FIELDS = ("epoch", "epochs", "step", "consumed", "num_samples", "world_size", "loss", "lr", "lr_scale",
          "accumulate")


class EtcdProgress:
    def __init__(self, client: EtcdClient, keys: JobKeys, rate: float = 2.0) -> None:
        self.client, self.keys = client, keys
        self.min_interval = 1.0 / rate
        self._latest: dict[str, Any] | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="etcd-progress", daemon=True)
        self._thread.start()
        atexit.register(self.flush)  # the last record (final metrics) must not die with the thread

    def flush(self) -> None:
        with self._cond:
            rec, self._latest = self._latest, None
        if rec is not None:
            try:
                self.client.put(self.keys.progress, json.dumps(rec))
            except (UnavailableError, EtcdError):
                pass

    @classmethod
    def from_env(cls) -> "EtcdProgress | None":
        found = client_from_env(timeout=2.0)
        return cls(*found) if found is not None else None

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec.get("kind") == "checkpoint":
            self._put_checkpoint(rec)
            return
        out = {k: rec.get(k) for k in FIELDS}
        out["samples_s"] = round(float(rec.get("samples_per_s") or 0.0), 2)
        out["node"] = os.environ.get("ELASTICYOLO_NODE_ID")
        out["at"] = time.time()
        if rec.get("metrics"):
            out["metrics"] = rec["metrics"]
        with self._cond:
            self._latest = out
            self._cond.notify()

    def _put_checkpoint(self, rec: dict[str, Any]) -> None:
        """The newest landed checkpoint, for `status` (`JobKeys.checkpoint_latest`). Rare (one per
        checkpoint), so written on a short-lived thread: never blocks a step."""
        body = json.dumps({k: v for k, v in rec.items() if k != "kind"})

        def put() -> None:
            try:
                self.client.put(self.keys.checkpoint_latest, body)
            except (UnavailableError, EtcdError):
                pass  # best effort: the next checkpoint overwrites it

        threading.Thread(target=put, name="etcd-checkpoint", daemon=True).start()

    def _run(self) -> None:
        last = 0.0
        while True:
            with self._cond:
                while self._latest is None:
                    self._cond.wait()
                rec, self._latest = self._latest, None
            try:
                self.client.put(self.keys.progress, json.dumps(rec))
            except (UnavailableError, EtcdError):
                pass  # best effort: the next record retries
            last_wait = self.min_interval - (time.monotonic() - last)
            last = time.monotonic()
            if last_wait > 0:
                time.sleep(last_wait)
