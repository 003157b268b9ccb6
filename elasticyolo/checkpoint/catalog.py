"""Reading a job's checkpoints from a store: manifests, the latest pointer, retention. No torch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from elasticyolo.checkpoint import layout
from elasticyolo.checkpoint.layout import Manifest
from elasticyolo.checkpoint.stores import NotFound, Store
from elasticyolo.errors import UserError
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.checkpoint")


def list_manifests(store: Store, job: str) -> list[Manifest]:
    """Every readable manifest of `job`, oldest first (by step, then landing time)."""
    out: list[Manifest] = []
    for info in store.list(layout.manifest_prefix(job)):
        if not info.key.endswith(".json"):
            continue
        try:
            out.append(Manifest.from_json(store.get_bytes(info.key)))
        except NotFound:
            continue  # pruned meanwhile
        except (ValueError, TypeError) as exc:
            log.warning("manifest_unreadable", job=job, key=info.key, error=str(exc)[:200])
    out.sort(key=lambda m: (m.step, m.created, m.name))
    return out


def read_latest(store: Store, job: str) -> Manifest | None:
    """The pointer the manager moves after each verified upload (None before the first one)."""
    try:
        return Manifest.from_json(store.get_bytes(layout.latest_key(job)))
    except NotFound:
        return None
    except (ValueError, TypeError) as exc:
        log.warning("latest_unreadable", job=job, error=str(exc)[:200])
        return None


def find(store: Store, job: str, which: str = "latest") -> Manifest:
    """`latest`, a step number, or a checkpoint name (as `list` prints it)."""
    manifests = list_manifests(store, job)
    if not manifests:
        raise UserError(f"job {job!r} has no checkpoints in {store.uri}")
    if which in ("latest", ""):
        pointer = read_latest(store, job)
        if pointer is not None and any(m.name == pointer.name for m in manifests):
            return next(m for m in manifests if m.name == pointer.name)
        return manifests[-1]
    if which.isdigit():
        hits = [m for m in manifests if m.step == int(which)]
    else:
        hits = [m for m in manifests if m.name == which or m.key == which]
    if not hits:
        raise UserError(f"job {job!r}: no checkpoint {which!r} in {store.uri} (see `elasticyolo checkpoints list`)")
    return hits[-1]


def retention_victims(manifests: list[Manifest], keep_last: int, keep_epochs: bool,
                      protect: set[str] | None = None) -> list[Manifest]:
    """Manifests to delete: all but the newest `keep_last`, except epoch-end ones when `keep_epochs`,
    and except names in `protect` (the latest pointer)."""
    ordered = sorted(manifests, key=lambda m: (m.step, m.created, m.name))
    keep = {m.name for m in ordered[-keep_last:]} if keep_last > 0 else set()
    keep |= protect or set()
    return [m for m in ordered if m.name not in keep and not (keep_epochs and m.epoch_end)]


@dataclass
class PruneResult:
    manifests: list[str] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)


def prune(store: Store, job: str, *, keep_last: int, keep_epochs: bool, orphan_grace_s: float = 3600.0,
          dry_run: bool = False) -> PruneResult:
    """Apply retention. Manifests go first, then their objects: a crash in between leaves an orphan
    object (removed later), never a manifest without its object. Objects without a manifest are
    removed once older than `orphan_grace_s` (an upload may be in flight)."""
    manifests = list_manifests(store, job)
    latest = read_latest(store, job)
    victims = retention_victims(manifests, keep_last, keep_epochs, {latest.name} if latest else set())
    kept_objects = {m.key for m in manifests if m not in victims}
    result = PruneResult([m.manifest_key for m in victims], [m.key for m in victims if m.key not in kept_objects])
    now = time.time()
    referenced = {m.key for m in manifests}
    for info in store.list(layout.ckpt_prefix(job)):
        if info.key not in referenced and now - info.last_modified > orphan_grace_s:
            result.objects.append(info.key)
    if not dry_run:
        if result.manifests:
            store.delete(result.manifests)
        if result.objects:
            store.delete(result.objects)
        if result.manifests or result.objects:
            log.info("checkpoints_pruned", job=job, manifests=len(result.manifests), objects=len(result.objects))
    return result
