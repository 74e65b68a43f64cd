"""Retries and error translation for the S3 back end (`s3.py`): which boto3 failures are
transient (throttling, 5xx, dropped connections), retried by the one policy of `retry.py`,
and the mapping of the rest onto our errors, so no boto3 exception type leaves
`trainckpt.storage`. boto3 is imported only inside these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from trainckpt.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from trainckpt.storage.retry import RETRY_STATUS, RetryPolicy

T = TypeVar("T")

_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
        "RequestLimitExceeded",
        "RequestTimeout",
        "InternalError",
        "ServiceUnavailable",
        "ConditionalRequestConflict",  # 409: a concurrent conditional write; S3 says retry
    }
)
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})


def call_with_retries(what: str, location: str, fn: Callable[[], T], retry_deadline: float) -> T:
    """Run one request, retrying transient failures by the one policy of `storage/retry.py`
    for at most `retry_deadline` seconds; raise every other failure as one of our errors.

    `what` ("reading", "writing", ...) and `location` go into the messages.
    """

    def gave_up(last: Exception, attempts: int) -> Exception:
        return _GaveUp(
            f"{what} '{location}' failed: the S3 endpoint did not answer "
            f"successfully within retry_deadline={retry_deadline:g}s "
            f"({attempts} attempts; last: {describe(last)}); check that the bucket "
            "is reachable (AWS_ENDPOINT_URL_S3 for S3-compatible stores), or raise "
            "retry_deadline"
        )

    try:
        return RetryPolicy(retry_deadline).call(fn, is_transient, gave_up, f"{what} '{location}'")
    except _GaveUp:
        raise
    except Exception as e:
        raise translate(e, what, location) from e


class _GaveUp(StorageError):
    """Transient failures until the deadline."""


class RangeNotSatisfiable(StorageError):
    """416 on a ranged read: the range starts at or past the end of the file."""


def _bucket_of(location: str) -> str:
    return location.split("://", 1)[-1].split("/", 1)[0]


def _error_code(e: Exception) -> tuple[str, int]:
    response = getattr(e, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_transient(e: Exception) -> bool:
    from botocore import exceptions as bx

    if isinstance(e, bx.ClientError):
        code, status = _error_code(e)
        return code in _RETRY_CODES or status in RETRY_STATUS
    transient: tuple[type[Exception], ...] = (
        bx.ConnectionError,  # connect/read timeouts, refused and closed connections
        bx.HTTPClientError,
        bx.IncompleteReadError,
        bx.ResponseStreamingError,
        ConnectionError,
        TimeoutError,
    )
    if isinstance(e, transient):
        return True
    try:  # a body read cut short surfaces as urllib3's own error
        from urllib3.exceptions import HTTPError as Urllib3Error
    except ImportError:  # pragma: no cover - urllib3 comes with botocore
        return False
    return isinstance(e, Urllib3Error)


def describe(e: Exception) -> str:
    code, status = _error_code(e)
    if code and code != str(status):
        return f"{code} (HTTP {status})"
    if status:
        return f"HTTP {status}"
    return f"{type(e).__name__}: {e}"


def translate(e: Exception, what: str, location: str) -> Exception:
    """An error of ours for a failure that retrying would not cure."""
    from botocore import exceptions as bx

    if isinstance(e, bx.ClientError):
        code, status = _error_code(e)
        if code == "NoSuchBucket":
            message = (
                f"{what} '{location}': bucket '{_bucket_of(location)}' does not exist; create it "
                "or fix the path (and AWS_ENDPOINT_URL_S3 for an S3-compatible store)"
            )
            # Nothing can be written there: that is not a missing file but a broken target.
            return StorageError(message) if what == "writing" else CheckpointNotFoundError(message)
        if code in _NOT_FOUND_CODES or status == 404:
            return CheckpointNotFoundError(f"'{location}' does not exist")
        if code == "PreconditionFailed" or status == 412:
            return CheckpointExistsError(
                f"'{location}' already exists; pass save_overwrite=True to replace it"
            )
        if code == "InvalidRange" or status == 416:
            return RangeNotSatisfiable(f"'{location}': range not satisfiable")
        if status in (401, 403):
            return StorageError(
                f"{what} '{location}' was refused ({code or status}): check the AWS credentials "
                "(AWS_PROFILE, AWS_ACCESS_KEY_ID) and their permissions on the bucket"
            )
        if code == "NotImplemented" or status == 501:
            return StorageError(
                f"{what} '{location}': the S3 endpoint does not implement this request "
                f"({code or status}: {e}); create-only writes need conditional writes "
                "(If-None-Match), which AWS S3, R2 and MinIO support"
            )
        return StorageError(f"{what} '{location}' failed ({code or status}: {e})")
    if isinstance(e, bx.NoCredentialsError | bx.PartialCredentialsError):
        return StorageError(
            f"{what} '{location}': no usable AWS credentials ({e}); set AWS_PROFILE or "
            "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
        )
    if isinstance(e, bx.BotoCoreError):
        return StorageError(f"{what} '{location}' failed ({type(e).__name__}: {e})")
    return (
        e
        if isinstance(e, StorageError)
        else StorageError(f"{what} '{location}' failed ({type(e).__name__}: {e})")
    )
