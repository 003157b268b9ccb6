"""Restore: the newest checkpoint whose object verifies against its manifest, else older ones.

`download_verified` needs no torch (the CLI uses it); `restore_latest` unpickles with torch.
Verification failures (missing object, wrong size or sha256, unreadable pickle) skip to the next
older checkpoint and say so in the log; an unreachable store raises (after the store's retries)
instead, so a network blip never silently rolls training back.
"""

from __future__ import annotations

import tempfile
from typing import IO, Any

from elasticyolo.checkpoint import catalog
from elasticyolo.checkpoint.layout import Manifest
from elasticyolo.checkpoint.hashing import sha256_of
from elasticyolo.checkpoint.stores import NotFound, Store
from elasticyolo.checkpoint.stores.retry import is_transient
from elasticyolo.errors import UnavailableError
from elasticyolo.log import get_logger

log = get_logger("elasticyolo.checkpoint")


class CorruptCheckpoint(Exception):
    pass


def download_verified(store: Store, manifest: Manifest, out: IO[bytes]) -> None:
    """Copy the object into `out` and check size and sha256 against the manifest."""
    try:
        store.download(manifest.key, out)
    except NotFound:
        raise CorruptCheckpoint(f"object {manifest.key} is missing") from None
    sha, size = sha256_of(out)
    if size != manifest.size:
        raise CorruptCheckpoint(f"object has {size} bytes, manifest says {manifest.size}")
    if sha != manifest.sha256:
        raise CorruptCheckpoint(f"sha256 {sha[:16]}.. does not match the manifest's {manifest.sha256[:16]}..")
    out.seek(0)


def restore_latest(store: Store, job: str, *, spool_max_bytes: int = 512 * 1024 * 1024,
                   ) -> tuple[dict[str, Any], Manifest] | None:
    """-> (checkpoint dict on CPU, its manifest), or None when the job has no usable checkpoint."""
    from elasticyolo.checkpoint.format import load_checkpoint_file

    manifests = catalog.list_manifests(store, job)
    skipped: list[str] = []
    for m in reversed(manifests):
        with tempfile.SpooledTemporaryFile(max_size=spool_max_bytes, prefix="elasticyolo-restore-") as spool:
            try:
                download_verified(store, m, spool)
                ckpt = load_checkpoint_file(spool)
            except CorruptCheckpoint as exc:
                reason = str(exc)
            except Exception as exc:  # noqa: BLE001 - classify below
                if is_transient(exc):
                    raise UnavailableError(f"checkpoint store {store.uri}: cannot read {m.key} ({type(exc).__name__})"
                                           ) from exc
                reason = f"unreadable: {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
            else:
                log.info("checkpoint_restored", job=job, step=m.step, epoch=m.epoch, epoch_step=m.epoch_step,
                         key=m.key, skipped=len(skipped), fallback=bool(skipped))
                return ckpt, m
        skipped.append(m.key)
        log.warning("checkpoint_skipped", job=job, step=m.step, key=m.key, reason=reason)
    if manifests:
        log.error("checkpoint_none_usable", job=job, tried=len(manifests))
    return None
