"""One S3 multipart upload, of a file's parts or of ranges copied server-side: create it, send
the parts in parallel, complete it (create-only unless overwriting), and abort it on any failure
so no invisible parts are left to pay for.

Split from `s3.py`, whose `S3Storage` uploads large files and copies large objects through it,
handing in its client, its retrying `_call` and its thread pool. Called on: any rank, for its
own files (an upload), or the one process copying (a server-side copy).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from botocore.client import BaseClient

log = logging.getLogger(__name__)

MAX_PARTS = 10_000
"""Most parts one multipart upload may have (an S3 limit)."""

Call = Callable[[str, str, Callable[[], Any]], Any]
"""`S3Storage._call`: run one request (`what`, `location`, request) with retries."""


def send_multipart(
    client: BaseClient,
    call: Call,
    in_parallel: Callable[[Callable[[Any], None], list[Any]], None],
    *,
    location: str,
    bucket: str,
    key: str,
    size: int,
    part_size: int,
    overwrite: bool,
    send_part: Callable[[str, str, str, int, int], Any],
    create_extra: dict[str, Any],
) -> None:
    """Create, send parts in parallel (`send_part(bucket, key, upload_id, number,
    part_size)` sends one), complete (create-only unless `overwrite`); abort on any failure
    so no invisible parts are left to pay for."""
    create: dict[str, Any] = {"Bucket": bucket, "Key": key, **create_extra}
    upload_id = call("writing", location, lambda: client.create_multipart_upload(**create))[
        "UploadId"
    ]
    parts: list[dict[str, Any]] = [{} for _ in range(max(1, -(-size // part_size)))]

    def send(number: int) -> None:
        answer = call(
            "writing", location, lambda: send_part(bucket, key, upload_id, number, part_size)
        )
        answer = answer.get("CopyPartResult", answer)
        part = {"PartNumber": number, "ETag": answer["ETag"]}
        if "ChecksumCRC32" in answer:
            part["ChecksumCRC32"] = answer["ChecksumCRC32"]
        parts[number - 1] = part

    complete: dict[str, Any] = {"Bucket": bucket, "Key": key, "UploadId": upload_id}
    if not overwrite:
        complete["IfNoneMatch"] = "*"
    try:
        in_parallel(send, list(range(1, len(parts) + 1)))
        call(
            "writing",
            location,
            lambda: client.complete_multipart_upload(MultipartUpload={"Parts": parts}, **complete),
        )
    except BaseException:
        _abort(client, call, location, bucket, key, upload_id)
        raise


def _abort(
    client: BaseClient, call: Call, location: str, bucket: str, key: str, upload_id: str
) -> None:
    try:
        call(
            "aborting the upload of",
            location,
            lambda: client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id),
        )
    except Exception as e:  # the original error matters more; this one is logged
        log.warning("could not abort the multipart upload of '%s': %s", location, e)
