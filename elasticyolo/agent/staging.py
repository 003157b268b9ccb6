"""The agent side of staging: a node offers its slots to a job only once the job's `s3://`
inputs are staged on it: its dataset, and its weights (`model=`, `pretrained=`).

`DataStagingHook` (an `AgentPlugin`) stages the active job's inputs, one after the other, on a
thread of its own and publishes progress in the node record (`data`: state staging/ready/failed,
files, bytes, seconds, summed over the inputs; `elasticyolo status` shows it). The engines ask
`data_ready(record)` before they use a node's slots (Horovod discovery, the torch launcher), so
staging time is part of a node's join time and no worker waits on a half-copied input. Workers
never contact S3 for them: they wait for this staging (`resolve_staged`) and hold a shared lock
on each copy, which keeps the cache's eviction away from it; the agent holds one too while the job
is active.

A failed staging (S3 unreachable, a corrupt object, access denied) is retried with backoff
(10 s doubling to 5 min) and resumes where it stopped; it never stops the agent.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any, Mapping

from elasticyolo.agent.plugin import AgentPlugin, NodeAPI
from elasticyolo.agent.state import NodeState
from elasticyolo.log import get_logger
from elasticyolo.s3options import s3_options
from elasticyolo.staging.cache import DatasetCache, DatasetLock
from elasticyolo.staging.stager import STAGER_ENV, StageProgress, StageResult, Stager, StagingCancelled, spec_sources

if TYPE_CHECKING:
    from elasticyolo.agent.job import JobView
    from elasticyolo.config import AgentConfig

RECORD_FIELD = "data"
PUBLISH_EVERY_S = 1.0
RETRY_S = (10.0, 300.0)


def data_ready(record: Mapping[str, Any]) -> bool:
    """May the engines use this node's slots? (No s3:// dataset, or it is staged.)"""
    data = record.get(RECORD_FIELD)
    return not isinstance(data, dict) or data.get("state") == "ready"


class DataStagingHook(AgentPlugin):
    def __init__(self, cfg: "AgentConfig") -> None:
        self.cfg = cfg
        self.cache = DatasetCache.from_settings(cfg.data_cache_dir, cfg.data_cache_max_gb)
        self.log = get_logger("elasticyolo.staging", node=cfg.node_id, job=cfg.job)
        self._want: tuple[tuple[str, ...], tuple[tuple[str, Any], ...]] | None = None  # (uris, S3 options) served now
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._progress: StageProgress | None = None
        self._result: StageResult | None = None
        self._error: str | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._started_at = 0.0
        self._in_use: list[DatasetLock] = []
        self._published: dict[str, Any] | None = None
        self._published_at = 0.0
        self._mutex = threading.Lock()

    # ---- hooks ----------------------------------------------------------------------------
    def on_start(self, agent: NodeAPI) -> None:
        # Workers find the same cache and the agent's S3 defaults through their environment.
        os.environ["ELASTICYOLO_DATA_CACHE"] = str(self.cache.root)
        os.environ[STAGER_ENV] = "agent"
        if self.cfg.data_cache_max_gb:
            os.environ["ELASTICYOLO_DATA_CACHE_MAX_GB"] = str(self.cfg.data_cache_max_gb)
        os.environ.update(self.cfg.s3_env())

    def on_job_change(self, agent: NodeAPI, job: "JobView") -> None:
        self._reconcile(agent)

    def on_tick(self, agent: NodeAPI) -> None:
        self._reconcile(agent)

    def on_drain(self, agent: NodeAPI, deadline: float) -> bool:
        self._cancel.set()
        return self._thread is None or not self._thread.is_alive()

    def on_stop(self, agent: NodeAPI) -> None:
        self._cancel.set()
        if self._thread is not None:
            self._thread.join(10)
        self._release()

    # ---- reconciliation (agent loop thread) ------------------------------------------------
    def _wanted(self, agent: NodeAPI) -> tuple[tuple[str, ...], tuple[tuple[str, Any], ...]] | None:
        job, spec = agent.job, agent.job.spec
        uris = tuple(spec_sources(spec)) if job.active and spec is not None else ()
        if not uris:
            return None
        if agent.state in (NodeState.LEFT, NodeState.FAILED):
            return None
        return uris, tuple(sorted(s3_options(uris[0], spec).items()))

    def _reconcile(self, agent: NodeAPI) -> None:
        if agent.state == NodeState.DRAINING:
            # Staging stopped (on_drain); the record stays as it is, so a node whose inputs are not
            # staged is not offered to a world while it hands over.
            self._publish(agent)
            return
        want = self._wanted(agent)
        if want != self._want:
            self._switch(want)
        running = self._thread is not None and self._thread.is_alive()
        if want is not None and not running and self._result is None and time.monotonic() >= self._retry_at:
            self._start(want)
        self._publish(agent)

    def _switch(self, want: tuple[tuple[str, ...], tuple[tuple[str, Any], ...]] | None) -> None:
        if self._thread is not None and self._thread.is_alive():
            self._cancel.set()
            self._thread.join(5)  # checks its cancel flag every 0.25 s; a straggler only stops
        self._release()
        self._want = want
        self._thread, self._progress, self._result, self._error = None, None, None, None
        self._failures, self._retry_at = 0, 0.0
        self._cancel = threading.Event()

    def _start(self, want: tuple[tuple[str, ...], tuple[tuple[str, Any], ...]]) -> None:
        uris, options = want
        self._cancel = threading.Event()
        self._started_at = time.time()
        self._error = None
        self._thread = threading.Thread(target=self._run, args=(uris, dict(options), self._cancel),
                                        name="data-staging", daemon=True)
        self._thread.start()

    def _run(self, uris: tuple[str, ...], options: dict[str, Any], cancel: threading.Event) -> None:
        def progress(p: StageProgress) -> None:
            with self._mutex:
                self._progress = p

        stager = Stager(self.cache, options, max_concurrency=self.cfg.data_max_concurrency, progress=progress,
                        cancel=cancel, log=self.log)
        locks: list[DatasetLock] = []
        try:
            results = []
            for uri in uris:
                results.append(stager.stage(uri))
                lock = DatasetLock(self.cache.entry(uri))
                locks.append(lock)
                lock.acquire(exclusive=False, cancelled=cancel.is_set)  # in use: not evictable
            with self._mutex:
                if cancel.is_set():
                    return
                self._in_use, self._result, self._failures = locks, combined(results), 0
                locks = []
        except StagingCancelled:
            return
        except Exception as exc:  # noqa: BLE001 - retried with backoff; never kills the agent
            if cancel.is_set():
                return
            with self._mutex:
                self._failures += 1
                delay = min(RETRY_S[0] * 2 ** (self._failures - 1), RETRY_S[1])
                self._retry_at = time.monotonic() + delay
                self._error = str(exc) if str(exc) else type(exc).__name__
            self.log.error("staging failed; will retry", sources=list(uris), error=self._error, retry_in_s=delay)
        finally:
            for lock in locks:  # not handed over: staging failed or was cancelled
                lock.close()

    def _release(self) -> None:
        with self._mutex:
            locks, self._in_use = self._in_use, []
        for lock in locks:
            lock.close()  # closing the descriptor drops the shared lock

    # ---- the node record --------------------------------------------------------------------
    def record(self) -> dict[str, Any] | None:
        """What `status` shows for this node's `s3://` inputs (None: the job has none)."""
        if self._want is None:
            return None
        with self._mutex:
            p, result, error = self._progress, self._result, self._error
            retry_in = max(0.0, self._retry_at - time.monotonic())
        uris = self._want[0]
        rec: dict[str, Any] = {"uri": uris[0], **({"uris": list(uris)} if len(uris) > 1 else {}),
                               "started_at": round(self._started_at, 3)}
        if result is not None:
            rec.update(state="ready", **result.as_record())
        elif error is not None and not (self._thread is not None and self._thread.is_alive()):
            rec.update(state="failed", error=error[:300], retry_in_s=round(retry_in, 1))
        else:
            rec["state"] = "staging"
            if p is not None:
                rec.update(phase=p.phase, files=p.files_total, bytes=p.bytes_total, done_files=p.files_done,
                           done_bytes=p.bytes_done, seconds=round(p.seconds, 1))
        return rec

    def _publish(self, agent: NodeAPI) -> None:
        rec = self.record()
        current = agent.record.extra.get(RECORD_FIELD)
        if rec is None:
            if current is not None:
                agent.set_record_field(RECORD_FIELD, None)
            return
        state_changed = not isinstance(current, dict) or current.get("state") != rec.get("state")
        if state_changed or (rec != current and time.monotonic() - self._published_at >= PUBLISH_EVERY_S):
            agent.set_record_field(RECORD_FIELD, rec)
            self._published_at = time.monotonic()
            if state_changed and rec["state"] == "ready":
                self.log.info("inputs staged; offering this node's slots", sources=rec.get("uris") or [rec["uri"]],
                              seconds=rec.get("seconds"), reused=rec.get("reused"))


def combined(results: list[StageResult]) -> StageResult:
    """One record for a job's staged inputs: counts and seconds summed, reused when all were."""
    first = results[0]
    if len(results) == 1:
        return first
    verified: dict[str, int] = {}
    for r in results:
        for k, v in r.verified.items():
            verified[k] = verified.get(k, 0) + v
    return StageResult(first.uri, first.path, sum(r.files for r in results), sum(r.bytes for r in results),
                       sum(r.downloaded_files for r in results), sum(r.downloaded_bytes for r in results),
                       sum(r.seconds for r in results), all(r.reused for r in results),
                       [e for r in results for e in r.evicted], verified, any(r.offline for r in results))
