"""Reading a job's checkpoints from a store: manifests, the latest pointer, retention. No torch."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

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


def retention_victims(names: list[str], keep_last: int, is_epoch_end: Callable[[str], bool] | None = None,
                      protect: set[str] | None = None) -> list[str]:
    """Checkpoint names to delete: all but the newest `keep_last` (names sort in training order:
    step, then snapshot time), except names in `protect` (the latest pointer) and, when
    `is_epoch_end` is given (keep_epochs), epoch-end checkpoints. `is_epoch_end` is asked only
    about names that would otherwise go."""
    ordered = sorted(names)
    keep = set(ordered[-keep_last:]) if keep_last > 0 else set()
    keep |= protect or set()
    return [n for n in ordered if n not in keep and not (is_epoch_end is not None and is_epoch_end(n))]


@dataclass
class PruneResult:
    manifests: list[str] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)


def prune(store: Store, job: str, *, keep_last: int, keep_epochs: bool, orphan_grace_s: float = 3600.0,
          dry_run: bool = False, latest_name: str | None = None, orphans: bool = True) -> PruneResult:
    """Apply retention. Manifests go first, then their objects: a crash in between leaves an orphan
    object (removed later), never a manifest without its object. Objects without a manifest are
    removed once older than `orphan_grace_s` (an upload may be in flight); `orphans=False` skips
    looking for them (a listing of every object).

    Runs after every checkpoint, so it goes by key names (listings) and reads a manifest only to
    ask whether a checkpoint that would go ends an epoch (`keep_epochs`). `latest_name`, where the
    caller has just read or moved `latest`, saves reading it again."""
    names = [layout.name_of(info.key) for info in store.list(layout.manifest_prefix(job)) if info.key.endswith(".json")]
    if latest_name is None:
        latest = read_latest(store, job)
        latest_name = latest.name if latest else None

    def is_epoch_end(name: str) -> bool:
        try:
            return Manifest.from_json(store.get_bytes(layout.manifest_key(job, name))).epoch_end
        except NotFound:
            return False  # pruned meanwhile
        except (ValueError, TypeError) as exc:
            log.warning("manifest_unreadable", job=job, name=name, error=str(exc)[:200])
            return True  # unknown: keep it

    victims = retention_victims(names, keep_last, is_epoch_end if keep_epochs else None,
                                {latest_name} if latest_name else set())
    result = PruneResult([layout.manifest_key(job, n) for n in victims], [layout.object_key(job, n) for n in victims])
    now = time.time()
    referenced = set(names)
    for info in store.list(layout.ckpt_prefix(job)) if orphans else ():
        if layout.name_of(info.key) not in referenced and now - info.last_modified > orphan_grace_s:
            result.objects.append(info.key)
    if not dry_run:
        if result.manifests:
            store.delete(result.manifests)
        if result.objects:
            store.delete(result.objects)
        if result.manifests or result.objects:
            log.info("checkpoints_pruned", job=job, manifests=len(result.manifests), objects=len(result.objects))
    return result
