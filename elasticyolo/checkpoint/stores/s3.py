"""`s3://bucket/prefix` through boto3 (AWS or any S3-compatible server: MinIO, Ceph, moto).

Configuration follows the standard AWS chain (env credentials, profile, instance role, region,
`AWS_ENDPOINT_URL` / `AWS_ENDPOINT_URL_S3`); explicit options override it. botocore's own retries
are turned off so that tenacity is the one retry layer (predictable delays for the manager).
"""

from __future__ import annotations

import base64
import re
import threading

import uuid
from typing import IO, Any, Iterator

from elasticyolo.checkpoint.stores import retry
from elasticyolo.checkpoint.stores.base import NotFound, ObjectInfo, PreconditionFailed
from elasticyolo.errors import UnavailableError, UserError

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-_]{1,253}[a-z0-9]$")
MiB = 1024 * 1024
_DENIED = frozenset({"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken",
                     "InvalidToken", "AllAccessDisabled", "AccountProblem", "403", "Forbidden",
                     "UnrecognizedClientException", "InvalidClientTokenId"})
_REGION = frozenset({"PermanentRedirect", "AuthorizationHeaderMalformed", "IllegalLocationConstraintException", "301"})


def valid_bucket_name(name: str) -> bool:
    return bool(_BUCKET.match(name)) and ".." not in name


class S3Store:
    supports_metadata = True

    def __init__(
        self,
        uri: str,
        bucket: str,
        prefix: str,
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        profile: str | None = None,
        sse: str | None = None,
        kms_key_id: str | None = None,
        addressing_style: str | None = None,
        retries: int = 6,
        retry_max_delay_s: float = 60.0,
        multipart_threshold: int = 64 * MiB,
        multipart_chunksize: int = 16 * MiB,
        max_concurrency: int = 4,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
    ) -> None:
        if sse not in (None, "", "AES256", "aws:kms", "aws:kms:dsse"):
            raise UserError(f"checkpoint store {uri!r}: sse must be AES256 or aws:kms, not {sse!r}")
        self.uri = uri
        self.bucket = bucket
        self.root = prefix.strip("/")
        self._endpoint_url = endpoint_url or None
        self._region = region or None
        self._profile = profile or None
        self._sse = (sse or ("aws:kms" if kms_key_id else None))
        self._kms_key_id = kms_key_id or None
        self._addressing_style = addressing_style
        self._attempts = retries
        self._max_delay = retry_max_delay_s
        self._connect_timeout, self._read_timeout = connect_timeout, read_timeout
        self._tx = dict(multipart_threshold=multipart_threshold, multipart_chunksize=multipart_chunksize,
                        max_concurrency=max_concurrency)
        self._client: Any = None
        self._lock = threading.Lock()

    # ---- plumbing -------------------------------------------------------------------------
    @property
    def client(self) -> Any:
        """Created on first use (thread-safe: boto3 clients are, sessions are not)."""
        with self._lock:
            if self._client is None:
                import boto3
                import botocore.config
                import botocore.exceptions as bce

                try:
                    session = boto3.session.Session(profile_name=self._profile, region_name=self._region)
                except bce.ProfileNotFound as exc:
                    raise UserError(f"checkpoint store {self.uri}: {exc}") from None
                # Bodies carry a checksum S3 verifies (our sha256, or botocore's CRC32): signing the
                # payload too, which botocore does over plain http, is one more full hash of it.
                s3cfg: dict[str, Any] = {"payload_signing_enabled": False}
                if self._addressing_style:
                    s3cfg["addressing_style"] = self._addressing_style
                cfg = botocore.config.Config(
                    retries={"mode": "standard", "total_max_attempts": 1},  # tenacity retries instead
                    connect_timeout=self._connect_timeout,
                    read_timeout=self._read_timeout,
                    s3=s3cfg,
                    max_pool_connections=max(10, self._tx["max_concurrency"] * 2),
                )
                self._client = session.client("s3", endpoint_url=self._endpoint_url, config=cfg)
            return self._client

    @property
    def endpoint(self) -> str:
        try:
            return str(self.client.meta.endpoint_url)
        except UserError:
            return self._endpoint_url or "default AWS endpoint"

    def _key(self, key: str) -> str:
        return f"{self.root}/{key}" if self.root else key

    def _rel(self, full: str) -> str:
        return full[len(self.root) + 1:] if self.root else full

    def _sse_args(self) -> dict[str, str]:
        args: dict[str, str] = {}
        if self._sse:
            args["ServerSideEncryption"] = self._sse
        if self._kms_key_id:
            args["SSEKMSKeyId"] = self._kms_key_id
        return args

    def _call(self, what: str, fn: Any, attempts: int | None = None) -> Any:
        return retry.call(fn, attempts or self._attempts, self._max_delay, what)

    # ---- checks ---------------------------------------------------------------------------
    def check(self, *, write: bool = False) -> None:
        """Fail fast with one line: bad credentials, missing bucket, unreachable endpoint, and with
        write=True also a missing PutObject/DeleteObject permission (probe object)."""
        try:
            self._call("check", lambda: self.client.list_objects_v2(Bucket=self.bucket, Prefix=self._key(""),
                                                                    MaxKeys=1), attempts=2)
            if write:
                probe = self._key(f".elasticyolo-write-check/{uuid.uuid4().hex}")
                self._call("check", lambda: self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"ok",
                                                                   **self._sse_args()), attempts=2)
                self._call("check", lambda: self.client.delete_object(Bucket=self.bucket, Key=probe), attempts=2)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - translated into one line below
            raise self.explain(exc) from None

    def explain(self, exc: BaseException) -> UserError:
        """Turn a boto error into a one-line UserError (or UnavailableError) naming the store."""
        import botocore.exceptions as bce

        where = f"checkpoint store {self.uri}"
        if isinstance(exc, (bce.NoCredentialsError, bce.PartialCredentialsError)):
            return UserError(f"{where}: no AWS credentials found (set AWS_PROFILE or AWS_ACCESS_KEY_ID/"
                             "AWS_SECRET_ACCESS_KEY, or attach an instance role)")
        if isinstance(exc, (bce.ConnectionError, bce.HTTPClientError)):
            return UnavailableError(f"{where}: cannot reach S3 at {self.endpoint} ({type(exc).__name__})")
        if isinstance(exc, bce.ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", "")) or "?"
            msg = " ".join(str(err.get("Message", "")).split())
            if code in ("NoSuchBucket", "404"):
                return UserError(f"{where}: bucket {self.bucket!r} does not exist (endpoint {self.endpoint})")
            if code in _DENIED:
                return UserError(f"{where}: access denied ({code}{': ' + msg if msg else ''}); "
                                 "check the credentials and the bucket policy")
            if code in _REGION:
                return UserError(f"{where}: bucket {self.bucket!r} is in another region ({code}); set AWS_REGION")
            if retry.is_transient(exc):
                return UnavailableError(f"{where}: S3 is not answering ({code}{': ' + msg if msg else ''})")
            return UserError(f"{where}: {code}{': ' + msg if msg else ''}")
        return UserError(f"{where}: {type(exc).__name__}: {' '.join(str(exc).split())}")

    # ---- data path ------------------------------------------------------------------------
    def put_bytes(self, key: str, data: bytes, *, if_none_match: bool = False,
                  content_type: str = "application/octet-stream") -> None:
        import botocore.exceptions as bce

        args: dict[str, Any] = dict(Bucket=self.bucket, Key=self._key(key), Body=data, ContentType=content_type,
                                    **self._sse_args())
        if if_none_match:
            args["IfNoneMatch"] = "*"  # S3 conditional write: never overwrite a manifest
        try:
            self._call(f"put {key}", lambda: self.client.put_object(**args))
        except bce.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                raise PreconditionFailed(key) from None
            raise

    def put_file(self, key: str, fileobj: IO[bytes], size: int, *, metadata: dict[str, str] | None = None,
                 sha256: str | None = None) -> None:
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(use_threads=True, **self._tx)
        extra: dict[str, Any] = {**self._sse_args()}
        if metadata:
            extra["Metadata"] = dict(metadata)
        if sha256 and size < self._tx["multipart_threshold"] and self._checksums_wanted():
            # One PUT: S3 checks the body against the sha256 we already computed, and botocore
            # skips its own CRC32 pass (multipart uploads keep CRC32: S3 has no whole-object
            # SHA-256 for them).
            extra["ChecksumSHA256"] = base64.b64encode(bytes.fromhex(sha256)).decode()
            extra["ChecksumAlgorithm"] = "SHA256"  # named too: some S3-compatible servers go by it

        def _upload() -> None:
            fileobj.seek(0)
            if size < self._tx["multipart_threshold"]:
                # One PUT on this thread: the transfer manager would start a thread pool for it,
                # and its reader wraps the body; the body's reads go to the socket as they are.
                self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=_NoClose(fileobj),
                                       ContentLength=size, **extra)
            else:
                self.client.upload_fileobj(_NoClose(fileobj), self.bucket, self._key(key), ExtraArgs=extra,
                                           Config=cfg)

        self._call(f"upload {key}", _upload)

    def _checksums_wanted(self) -> bool:
        """False where the user turned upload checksums off for a server that rejects them
        (`AWS_REQUEST_CHECKSUM_CALCULATION=when_required`, or the same in the AWS config)."""
        return getattr(self.client.meta.config, "request_checksum_calculation", "when_supported") != "when_required"

    def get_bytes(self, key: str) -> bytes:
        import botocore.exceptions as bce

        def _get() -> bytes:
            return bytes(self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read())

        try:
            return bytes(self._call(f"get {key}", _get))
        except bce.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise NotFound(key) from None
            raise

    def download(self, key: str, fileobj: IO[bytes]) -> None:
        import botocore.exceptions as bce
        from boto3.s3.transfer import TransferConfig

        cfg = TransferConfig(use_threads=True, **self._tx)

        def _download() -> None:
            fileobj.seek(0)
            fileobj.truncate()
            self.client.download_fileobj(self.bucket, self._key(key), fileobj, Config=cfg)

        try:
            self._call(f"download {key}", _download)
        except bce.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise NotFound(key) from None
            raise

    def head(self, key: str) -> ObjectInfo | None:
        import botocore.exceptions as bce

        try:
            r = self._call(f"head {key}", lambda: self.client.head_object(Bucket=self.bucket, Key=self._key(key)))
        except bce.ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404", "NotFound"):
                return None
            raise
        return ObjectInfo(key, int(r["ContentLength"]), r["LastModified"].timestamp(), dict(r.get("Metadata") or {}))

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        token: str | None = None
        while True:
            args: dict[str, Any] = dict(Bucket=self.bucket, Prefix=self._key(prefix))
            if token:
                args["ContinuationToken"] = token
            page = self._call(f"list {prefix}", lambda: self.client.list_objects_v2(**args))
            for obj in page.get("Contents", []):
                yield ObjectInfo(self._rel(obj["Key"]), int(obj["Size"]), obj["LastModified"].timestamp())
            if not page.get("IsTruncated"):
                return
            token = page.get("NextContinuationToken")

    def delete(self, keys: list[str]) -> None:
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._key(k)} for k in keys[i:i + 1000]]
            r = self._call("delete", lambda: self.client.delete_objects(Bucket=self.bucket,
                                                                         Delete={"Objects": batch, "Quiet": True}))
            errors = r.get("Errors") or []
            if errors:
                first = errors[0]
                raise RuntimeError(f"delete failed for {len(errors)} keys, e.g. {first.get('Key')}: {first.get('Code')}")

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r})"




class _NoClose:
    """botocore closes the request body when a connection drops; the caller's file must survive
    for the retry, so boto only ever sees this view of it."""

    def __init__(self, f: IO[bytes]) -> None:
        self._f = f

    def read(self, n: int = -1) -> bytes | memoryview:
        return self._f.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def close(self) -> None:
        pass

    @property
    def closed(self) -> bool:
        return False
