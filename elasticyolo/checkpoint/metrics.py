"""Prometheus metrics of the checkpoint manager (labelled by job), on the default registry unless
the caller passes one (e.g. the worker's metrics module)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class CheckpointMetrics:
    snapshot_seconds: Histogram
    upload_seconds: Histogram
    upload_bytes: Counter
    upload_failures: Counter
    saved: Counter
    superseded: Counter
    last_step: Gauge
    last_success: Gauge

    def for_job(self, job: str) -> dict[str, Any]:
        return {name: getattr(self, name).labels(job=job) for name in self.__dataclass_fields__}


_lock = threading.Lock()
_by_registry: dict[int, CheckpointMetrics] = {}


def get_metrics(registry: CollectorRegistry | None = None) -> CheckpointMetrics:
    reg = registry or REGISTRY
    with _lock:
        if id(reg) not in _by_registry:
            kw: dict[str, Any] = dict(labelnames=("job",), registry=reg)
            _by_registry[id(reg)] = CheckpointMetrics(
                Histogram("elasticyolo_checkpoint_snapshot_seconds", "training blocked per checkpoint", buckets=_BUCKETS, **kw),
                Histogram("elasticyolo_checkpoint_upload_seconds", "serialize+hash+upload+verify per checkpoint",
                          buckets=_BUCKETS, **kw),
                Counter("elasticyolo_checkpoint_upload_bytes", "bytes of checkpoints that landed", **kw),
                Counter("elasticyolo_checkpoint_upload_failures", "failed upload attempts", **kw),
                Counter("elasticyolo_checkpoint_saved", "checkpoints that landed", **kw),
                Counter("elasticyolo_checkpoint_superseded", "snapshots dropped for a newer one", **kw),
                Gauge("elasticyolo_checkpoint_last_step", "step of the newest landed checkpoint", **kw),
                Gauge("elasticyolo_checkpoint_last_success_timestamp_seconds", "when the newest checkpoint landed", **kw),
            )
        return _by_registry[id(reg)]
