"""What rank 0 of every engine reports to etcd for `elasticyolo status` and the drain: training
progress (`progress`), the newest landed checkpoint (`checkpoint/latest`) and one record per
(re)start of training (`resume`). Engine-neutral and torch-free.

The first `resume` record of a submission also moves the job from `submitted` to `running`
(a no-op where the engine's coordinator did that already).

`EtcdProgress` is a sink of the training loop (one record per step) and of the `Checkpointer`
(one `{"kind": "checkpoint", ...}` record per landed checkpoint). Progress writes are rate-limited
(at most `rate` per second) and done by a background thread, so a slow or unreachable etcd never
stalls a step; the latest record wins. Connection settings come from the environment the agent
wrote (`worker_env.py`), never the command line.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from typing import Any, Callable

from elasticyolo.cluster.etcd import EtcdClient, EtcdError
from elasticyolo.cluster.job_state import JobEvent
from elasticyolo.cluster.jobs import set_job_state
from elasticyolo.cluster.keys import JobKeys
from elasticyolo.errors import UnavailableError
from elasticyolo.exit_hooks import at_exit
from elasticyolo.log import get_logger
from elasticyolo.worker_runtime import worker_env
from elasticyolo.worker_runtime.options import WorkerOptions
from elasticyolo.worker_runtime.worker_env import WorkerEnv

FIELDS = ("epoch", "epochs", "step", "consumed", "num_samples", "world_size", "loss", "lr", "lr_scale",
          "accumulate")

log = get_logger("elasticyolo.progress")
# The loop's samples/s is a window of 10 steps: the steady per-worker rate (cost.py's goodput
# denominator) is only taken once a window holds no start-up step.
STEADY_AFTER_STEPS = 10


class EtcdProgress:
    def __init__(self, client: EtcdClient, keys: JobKeys, rate: float = 2.0, node_id: str | None = None,
                 term: int | None = None, generation: int | None = None) -> None:
        self.client, self.keys = client, keys
        self.node_id, self.term, self.generation = node_id, term, generation
        self._marked_running = False
        self._steps_seen = 0
        self.steady_per_worker: float | None = None  # best per-worker samples/s once the window is full
        self.min_interval = 1.0 / rate
        self._latest: tuple[int, dict[str, Any]] | None = None
        self._cond = threading.Condition()
        # Writers of one key (the publisher thread, `flush`, checkpoint threads) may race: a put
        # is skipped when a newer record of its key was written already (seen: a job that ended
        # at step 400 showed 399, the publisher's put landing after the final flush's).
        self._order = itertools.count(1)
        self._put_lock = threading.Lock()
        self._written: dict[str, int] = {}
        self._thread = threading.Thread(target=self._run, name="etcd-progress", daemon=True)
        self._thread.start()
        at_exit(self.flush)  # the last record (final metrics) must not die with the thread

    @classmethod
    def from_env(cls, env: WorkerEnv | None = None) -> "EtcdProgress | None":
        """The sink of a worker started by an agent; None otherwise (e.g. under plain horovodrun)."""
        env = env or worker_env.read()
        found = env.etcd_client(timeout=2.0)
        if found is None:
            return None
        return cls(*found, node_id=env.node_id, term=env.term, generation=env.generation)

    def flush(self) -> None:
        with self._cond:
            latest, self._latest = self._latest, None
        if latest is not None:
            self._put_in_order(self.keys.progress, latest[0], json.dumps(latest[1]))

    def _put_in_order(self, key: str, order: int, body: str) -> None:
        """Best effort: a failed put is overwritten by the next record of its key."""
        with self._put_lock:
            if order <= self._written.get(key, 0):
                return
            try:
                self.client.put(key, body)
            except (UnavailableError, EtcdError):
                return
            self._written[key] = order

    def __call__(self, rec: dict[str, Any]) -> None:
        if rec.get("kind") == "checkpoint":
            self._put_soon(self.keys.checkpoint_latest, {k: v for k, v in rec.items() if k != "kind"})
            return
        out = {k: rec.get(k) for k in FIELDS}
        out["samples_s"] = round(float(rec.get("samples_per_s") or 0.0), 2)
        self._steps_seen += 1
        world = int(rec.get("world_size") or 0)
        if self._steps_seen > STEADY_AFTER_STEPS and world > 0 and rec.get("samples_per_s"):
            per_worker = float(rec["samples_per_s"]) / world
            self.steady_per_worker = max(self.steady_per_worker or 0.0, per_worker)
        out["steady_samples_s_per_worker"] = (round(self.steady_per_worker, 4)
                                              if self.steady_per_worker is not None else None)
        out["node"] = self.node_id
        out["at"] = time.time()
        if rec.get("metrics"):
            out["metrics"] = rec["metrics"]
        with self._cond:
            self._latest = (next(self._order), out)
            self._cond.notify()

    def resume(self, step: int, world: int, lost_steps: int | None, reason: str, **extra: Any) -> None:
        """One record per (re)start of training, for the draining agent (lost steps) and `status`.
        Written synchronously: it is rare, and a drain waits for it."""
        rec = {"step": step, "world": world, "lost_steps": lost_steps, "reason": reason, "term": self.term,
               "at": time.time(), **extra}
        try:
            self.client.put(self.keys.resume, json.dumps(rec))
            if not self._marked_running and self.generation is not None:
                set_job_state(self.client, self.keys, JobEvent.START, generation=self.generation,
                              by=f"rank 0 on {self.node_id}")
                self._marked_running = True
        except (UnavailableError, EtcdError) as exc:
            log.warning("could not publish the resume record", error=str(exc))

    def _put_soon(self, key: str, value: dict[str, Any]) -> None:
        """Rare records (one per checkpoint) on a short-lived thread: never blocks a step."""
        order, body = next(self._order), json.dumps(value)
        threading.Thread(target=self._put_in_order, args=(key, order, body), name="etcd-record",
                         daemon=True).start()

    def _run(self) -> None:
        last = 0.0
        while True:
            with self._cond:
                while self._latest is None:
                    self._cond.wait()
                (order, rec), self._latest = self._latest, None
            self._put_in_order(self.keys.progress, order, json.dumps(rec))
            last_wait = self.min_interval - (time.monotonic() - last)
            last = time.monotonic()
            if last_wait > 0:
                time.sleep(last_wait)


Sink = Callable[[dict[str, Any]], None]


def worker_sinks(options: WorkerOptions, env: WorkerEnv | None = None) -> tuple[list[Sink], EtcdProgress | None]:
    """Rank 0's progress sinks for a worker: `--progress-jsonl` and, when started by an agent,
    etcd. Returns (sinks, the etcd sink or None) - the latter also takes `resume` records."""
    sinks: list[Sink] = []
    if options.progress_jsonl:
        from elasticyolo.train.report import JsonLines

        sinks.append(JsonLines(open(options.progress_jsonl, "a")))
    etcd = EtcdProgress.from_env(env)
    if etcd is not None:
        sinks.append(etcd)
    return sinks, etcd

