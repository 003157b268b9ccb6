"""Checkpoint stores chosen by URI: `s3://bucket/prefix` or `file:///path`."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from elasticyolo.checkpoint.stores.base import NotFound, ObjectInfo, PreconditionFailed, Store
from elasticyolo.errors import UserError

__all__ = ["NotFound", "ObjectInfo", "PreconditionFailed", "Store", "open_store", "parse_uri"]


def parse_uri(uri: str) -> tuple[str, str, str]:
    """-> (scheme, bucket-or-empty, prefix-or-path). UserError on anything else."""
    if not uri or not isinstance(uri, str):
        raise UserError("checkpoint store: empty URI (expected s3://bucket/prefix or file:///path)")
    parsed = urlparse(uri)
    if parsed.scheme == "s3":
        bucket = parsed.netloc
        if not bucket:
            raise UserError(f"checkpoint store {uri!r}: no bucket name (expected s3://bucket/prefix)")
        if parsed.query or parsed.fragment:
            raise UserError(f"checkpoint store {uri!r}: unexpected '?' or '#' in an S3 URI")
        from elasticyolo.checkpoint.stores.s3 import valid_bucket_name

        if not valid_bucket_name(bucket):
            raise UserError(f"checkpoint store {uri!r}: {bucket!r} is not a valid S3 bucket name")
        return "s3", bucket, parsed.path.strip("/")
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise UserError(f"checkpoint store {uri!r}: file URIs need an absolute path (file:///path)")
        if not parsed.path.startswith("/"):
            raise UserError(f"checkpoint store {uri!r}: file URIs need an absolute path (file:///path)")
        return "file", "", parsed.path
    if not parsed.scheme and uri.startswith("/"):
        raise UserError(f"checkpoint store {uri!r}: write it as file://{uri}")
    raise UserError(f"checkpoint store {uri!r}: unsupported scheme (expected s3://bucket/prefix or file:///path)")


def open_store(uri: str, **options: Any) -> Store:
    """Open the store for `uri`. S3 options: endpoint_url, region, profile, sse ("AES256" or
    "aws:kms"), kms_key_id, retries (tenacity attempts), multipart_threshold, multipart_chunksize,
    max_concurrency, connect_timeout, read_timeout. File stores take no options. Cheap: nothing is
    contacted until the first call (use `store.check()` to fail early)."""
    scheme, bucket, path = parse_uri(uri)
    if scheme == "s3":
        from elasticyolo.checkpoint.stores.s3 import S3Store

        return S3Store(uri, bucket, path, **options)
    from elasticyolo.checkpoint.stores.file import FileStore

    unknown = set(options) - {"retries"}
    if unknown:
        raise UserError(f"checkpoint store {uri!r}: options {sorted(unknown)} apply to s3:// stores only")
    return FileStore(uri, path)
