"""`elasticyolo data upload DIR s3://bucket/prefix`: put a local dataset where staging reads it.

Every file under DIR goes to `prefix/<relative path>` through boto3's transfer manager (parallel,
multipart for large files), with the S3 options' server-side encryption on every object.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from elasticyolo.errors import UserError


def upload_dataset(directory: Path, uri: str, options: dict[str, Any], concurrency: int = 16) -> tuple[int, int, float]:
    """Upload; returns (files, bytes, seconds). UserError with one line on bad input."""
    from s3transfer.manager import TransferConfig, TransferManager

    from elasticyolo.checkpoint.stores import parse_uri
    from elasticyolo.staging.stager import s3_client

    scheme, bucket, prefix = parse_uri(uri)
    if scheme != "s3":
        raise UserError(f"upload target {uri!r}: expected s3://bucket/prefix")
    if not (directory / "data.yaml").is_file():
        raise UserError(f"{directory}: no data.yaml (upload the directory that holds it)")
    files = sorted(p for p in directory.rglob("*") if p.is_file() and not p.is_symlink())
    extra: dict[str, str] = {}
    sse = options.get("sse") or ("aws:kms" if options.get("kms_key_id") else None)
    if sse:
        extra["ServerSideEncryption"] = str(sse)
    if options.get("kms_key_id"):
        extra["SSEKMSKeyId"] = str(options["kms_key_id"])
    t0 = time.monotonic()
    tm = TransferManager(s3_client(options, concurrency), TransferConfig(max_request_concurrency=concurrency))
    try:
        futures = [tm.upload(str(p), bucket, f"{prefix}/{p.relative_to(directory).as_posix()}".lstrip("/"),
                             extra_args=dict(extra)) for p in files]
        for f in futures:
            f.result()
    except Exception as exc:  # noqa: BLE001 - one line
        raise UserError(f"upload to {uri}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
    finally:
        tm.shutdown()
    return len(files), sum(p.stat().st_size for p in files), time.monotonic() - t0
