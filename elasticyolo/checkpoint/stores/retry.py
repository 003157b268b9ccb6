"""Which storage errors are worth retrying, and the tenacity policy that retries them."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from tenacity import Retrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential_jitter

from elasticyolo.log import get_logger

T = TypeVar("T")
log = get_logger("elasticyolo.checkpoint.store")

# S3 (and S3-compatible) error codes that mean "try again later", not "you are wrong".
TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
    "RequestLimitExceeded", "TooManyRequestsException", "RequestTimeout", "RequestTimeoutException",
    "InternalError", "ServiceUnavailable", "ConditionalRequestConflict", "OperationAborted",
    "500", "502", "503", "504",
})


def is_transient(exc: BaseException) -> bool:
    try:
        import botocore.exceptions as bce
        from boto3.exceptions import S3UploadFailedError
    except ImportError:  # pragma: no cover - boto3 is a core dependency
        return isinstance(exc, (ConnectionError, TimeoutError))
    if isinstance(exc, (bce.ConnectionError, bce.HTTPClientError, ConnectionError, TimeoutError)):
        return True
    if isinstance(exc, bce.ClientError):
        err = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return str(err.get("Code", "")) in TRANSIENT_CODES or status in (500, 502, 503, 504)
    if isinstance(exc, S3UploadFailedError):  # the transfer manager wraps ClientError in a string
        text = str(exc)
        return any(f"({code})" in text for code in TRANSIENT_CODES)
    return False


def retrying(attempts: int, max_delay_s: float, what: str) -> Retrying:
    """Exponential backoff with jitter on transient errors only; re-raises the last error."""

    def _before_sleep(state: Any) -> None:
        exc = state.outcome.exception() if state.outcome else None
        log.warning("store_retry", op=what, attempt=state.attempt_number, error=_short(exc))

    return Retrying(
        retry=retry_if_exception(is_transient),
        stop=stop_after_attempt(max(1, attempts)) | stop_after_delay(max_delay_s),
        wait=wait_exponential_jitter(multiplier=0.2, max=10.0, jitter=0.3),
        before_sleep=_before_sleep,
        reraise=True,
    )


def call(fn: Callable[[], T], attempts: int, max_delay_s: float, what: str) -> T:
    return retrying(attempts, max_delay_s, what)(fn)


def _short(exc: BaseException | None) -> str:
    return "" if exc is None else f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]
