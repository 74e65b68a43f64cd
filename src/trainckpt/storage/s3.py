"""Amazon S3 and S3-compatible stores (`s3://bucket/prefix`: AWS, Cloudflare R2, MinIO, WEKA)
through `boto3` (the `trainckpt[s3]` extra, imported only when an `s3://` path is used).

Endpoint, region, profile and credentials come from boto3's standard sources: the variables
`AWS_ENDPOINT_URL_S3` (or `AWS_ENDPOINT_URL`), `AWS_REGION`, `AWS_PROFILE`,
`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY`, and `~/.aws/config` (where `addressing_style =
path` and `request_checksum_calculation` are set for stores that need them). With no credentials
at all, requests go unsigned (public buckets), as cached-path does.

Every request retries throttling (503 SlowDown, 429) and 5xx answers and connection errors with
exponential backoff and jitter, for at most `StorageOptions.retry_deadline` seconds, by the one
policy of `retry.py` (botocore's own retries are off, so the deadline is the only bound).
Create-only writes send `If-None-Match: *`, so two writers cannot both succeed. Large files go up in
multipart uploads whose parts are sent in parallel; listings follow continuation tokens (S3 pages at
1,000 keys); deletes go in `DeleteObjects` batches of 1,000 keys. No exception type of boto3 leaves
here.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from trainckpt.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from trainckpt.storage.base import Listing, StorageOptions, Versioned
from trainckpt.storage.remote import RemoteStorage
from trainckpt.storage.s3_client import endpoint_from_env, new_client
from trainckpt.storage.s3_errors import RangeNotSatisfiable, call_with_retries
from trainckpt.storage.s3_multipart import MAX_PARTS, send_multipart

if TYPE_CHECKING:
    from botocore.client import BaseClient

SCHEME = "s3://"
MiB = 1024 * 1024
DELETE_BATCH = 1000
"""Most keys one `DeleteObjects` request may name (an S3 limit)."""
MIN_PART_SIZE = 5 * MiB
"""Smallest part but the last that S3 accepts."""
MAX_COPY_SIZE = 5 * 1024 * MiB
"""Largest object one `CopyObject` may copy (an S3 limit); larger ones are copied in parts."""

T = TypeVar("T")


class S3Storage(RemoteStorage):
    """Objects in S3 buckets. One instance (and one client) per set of options and endpoint."""

    scheme = SCHEME

    def __init__(
        self,
        options: StorageOptions,
        *,
        multipart_threshold: int = 64 * MiB,
        part_size: int = 32 * MiB,
        copy_threshold: int = MAX_COPY_SIZE,
    ) -> None:
        """`multipart_threshold`: files at least this large go up in parts of `part_size`
        (raised when needed to stay within S3's 10,000 parts); `copy_threshold`: files at least
        this large are copied in parts of `part_size` too."""
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum)")
        super().__init__(options)
        self.multipart_threshold = multipart_threshold
        self.part_size = part_size
        self.copy_threshold = min(copy_threshold, MAX_COPY_SIZE)
        self._client: BaseClient | None = None
        self._client_lock = threading.Lock()

    @classmethod
    def shared(cls, options: StorageOptions) -> S3Storage:
        """The instance for `options` and the current endpoint variables (a changed endpoint
        gets a new client)."""
        if importlib.util.find_spec("boto3") is None:
            from trainckpt.errors import ConfigurationError

            raise ConfigurationError(
                "s3:// paths need boto3, which is not installed: pip install 'trainckpt[s3]'"
            )
        return super().shared(options)

    @classmethod
    def endpoint(cls) -> str | None:
        return endpoint_from_env()

    @property
    def client(self) -> BaseClient:
        """The boto3 client, created on first use (boto3 clients are thread-safe)."""
        with self._client_lock:
            if self._client is None:
                self._client = new_client(self.options)
            return self._client

    def _folder_prefix(self, location: str) -> str:
        _, key = self.split(location)
        return f"{key}/" if key else ""

    def _object(self, location: str) -> tuple[str, str]:
        bucket, key = self.split(location)
        if not key:
            raise CheckpointNotFoundError(f"'{location}' is a bucket, not a file")
        return bucket, key

    # -- reading -----------------------------------------------------------------------------
    def list_dir(self, location: str) -> Listing:
        dirs: list[str] = []
        files: dict[str, int] = {}
        prefix = self._folder_prefix(location)
        for page in self._pages(location, delimiter="/"):
            for common in page.get("CommonPrefixes", []):
                dirs.append(common["Prefix"][len(prefix) :].rstrip("/"))
            for obj in page.get("Contents", []):
                if obj["Key"] != prefix:  # a "folder marker" object some tools create
                    files[obj["Key"][len(prefix) :]] = int(obj["Size"])
        return Listing(dirs=sorted(dirs), files=files)

    def list_files(self, location: str) -> dict[str, int]:
        prefix = self._folder_prefix(location)
        return {
            obj["Key"][len(prefix) :]: int(obj["Size"])
            for page in self._pages(location)
            for obj in page.get("Contents", [])
            if obj["Key"] != prefix and not obj["Key"].endswith("/")
        }

    def _pages(self, location: str, delimiter: str = "") -> Iterator[dict[str, Any]]:
        """Every page of `ListObjectsV2` below `location`, following continuation tokens;
        each page is one retried request."""
        bucket, _ = self.split(location)
        args: dict[str, Any] = {"Bucket": bucket, "Prefix": self._folder_prefix(location)}
        if delimiter:
            args["Delimiter"] = delimiter
        while True:
            page: dict[str, Any] = self._call(
                "listing", location, functools.partial(self.client.list_objects_v2, **args)
            )
            yield page
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return
            args = {**args, "ContinuationToken": token}

    def size(self, location: str) -> int:
        bucket, key = self._object(location)
        head = self._call(
            "reading", location, lambda: self.client.head_object(Bucket=bucket, Key=key)
        )
        return int(head["ContentLength"])

    def read_bytes(self, location: str, start: int = 0, end: int | None = None) -> bytes:
        bucket, key = self._object(location)
        if end is not None and end <= start:
            self.size(location)  # still raise for a missing file
            return b""
        args: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if start or end is not None:
            args["Range"] = f"bytes={start}-{'' if end is None else end - 1}"

        def get() -> bytes:
            body = self.client.get_object(**args)["Body"]
            try:
                return cast(bytes, body.read())
            finally:
                body.close()

        try:
            return self._call("reading", location, get)
        except RangeNotSatisfiable:
            return b""  # `start` at or past the end of the file, as a local read gives

    def local_copy(self, location: str, cache_dir: Path) -> Path:
        self._object(location)  # a clear CheckpointNotFoundError before cached-path's own
        return super().local_copy(location, cache_dir)

    # -- writing -----------------------------------------------------------------------------
    def write_bytes(
        self, location: str, data: bytes, *, overwrite: bool = True, make_parents: bool = True
    ) -> None:
        self._put(location, data, overwrite)

    def upload(self, local: Path, location: str, *, overwrite: bool = True) -> None:
        size = os.path.getsize(local)
        if size < self.multipart_threshold:
            self._put(location, Path(local), overwrite)
        else:
            self._upload_multipart(Path(local), size, location, overwrite)

    def upload_many(self, pairs: list[tuple[Path, str]], *, overwrite: bool = True) -> None:
        """Small files go up in parallel, one request each; large ones one after the other,
        each with its parts in parallel: at most `thread_count` requests run at once."""
        is_small = [os.path.getsize(local) < self.multipart_threshold for local, _ in pairs]
        small = [pair for pair, yes in zip(pairs, is_small, strict=True) if yes]
        large = [pair for pair, yes in zip(pairs, is_small, strict=True) if not yes]
        self._in_parallel(lambda pair: self.upload(*pair, overwrite=overwrite), small)
        for local, location in large:
            self.upload(local, location, overwrite=overwrite)

    def read_versioned(self, location: str) -> Versioned:
        bucket, key = self._object(location)

        def get() -> Versioned:
            answer = self.client.get_object(Bucket=bucket, Key=key)
            body = answer["Body"]
            try:
                data = cast(bytes, body.read())
            finally:
                body.close()
            return Versioned(data=data, version=str(answer.get("ETag", "")).strip('"'))

        return self._call("reading", location, get)

    def write_versioned(self, location: str, data: bytes, *, version: str | None) -> str:
        return self._put(location, data, overwrite=False, if_match=version)

    def _put(
        self, location: str, source: bytes | Path, overwrite: bool, if_match: str | None = None
    ) -> str:
        """One `PutObject` of bytes or a local file, create-only (`If-None-Match: *`) unless
        `overwrite`, or only over the version `if_match` (`If-Match`); returns the ETag."""
        bucket, key = self._object(location)
        args: dict[str, Any] = {"Bucket": bucket, "Key": key}
        if if_match is not None:
            args["IfMatch"] = f'"{if_match}"'
        elif not overwrite:
            args["IfNoneMatch"] = "*"
        attempts = 0

        def put() -> str:
            nonlocal attempts
            attempts += 1
            if isinstance(source, bytes):
                answer = self.client.put_object(Body=source, **args)
            else:
                with open(source, "rb") as f:  # reopened per attempt: a retry sends it all again
                    answer = self.client.put_object(Body=f, **args)
            return str(answer.get("ETag", "")).strip('"')

        try:
            return self._call("writing", location, put)
        except CheckpointExistsError:
            if attempts > 1 and self._etag(location) == _md5(source):
                # An earlier attempt stored these very bytes but its answer was lost; the
                # retry then found its own object.
                return _md5(source)
            raise

    def _etag(self, location: str) -> str:
        bucket, key = self._object(location)
        head = self._call(
            "reading", location, lambda: self.client.head_object(Bucket=bucket, Key=key)
        )
        return str(head.get("ETag", "")).strip('"')

    def _upload_multipart(self, local: Path, size: int, location: str, overwrite: bool) -> None:
        """A multipart upload of `local` whose parts S3 checks (CRC32) where the client asks
        for checksums, as boto3's own uploads do."""
        checksum = self.client.meta.config.request_checksum_calculation == "when_supported"

        def upload_part(bucket: str, key: str, upload_id: str, number: int, part_size: int) -> Any:
            with open(local, "rb") as f:
                f.seek((number - 1) * part_size)
                data = f.read(part_size)
            return self.client.upload_part(
                Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=data
            )

        extra = {"ChecksumAlgorithm": "CRC32"} if checksum else {}
        self._multipart(location, size, overwrite, upload_part, extra)

    def _multipart(
        self,
        location: str,
        size: int,
        overwrite: bool,
        send_part: Callable[[str, str, str, int, int], Any],
        create_extra: dict[str, Any],
    ) -> None:
        """A multipart upload to `location` in parts of `part_size` (raised to stay within
        S3's 10,000 parts), `send_multipart`."""
        bucket, key = self._object(location)
        part_size = max(self.part_size, -(-size // MAX_PARTS))
        send_multipart(
            self.client,
            self._call,
            self._in_parallel,
            location=location,
            bucket=bucket,
            key=key,
            size=size,
            part_size=part_size,
            overwrite=overwrite,
            send_part=send_part,
            create_extra=create_extra,
        )

    def copy_file(self, src: str, dst: str) -> None:
        """A server-side copy: one `CopyObject` below `copy_threshold` bytes, else a multipart
        upload of `UploadPartCopy` parts; create-only (`If-None-Match: *`). Stores that ignore
        that header on copies (moto; some S3-compatible stores) are covered by a look-up of
        `dst` first, which two racing copies can both pass."""
        src_bucket, src_key = self._object(src)
        bucket, key = self._object(dst)
        head = self._call(
            "reading", src, lambda: self.client.head_object(Bucket=src_bucket, Key=src_key)
        )
        size, etag = int(head["ContentLength"]), str(head.get("ETag", "")).strip('"')
        if self.exists(dst):
            raise CheckpointExistsError(
                f"cannot copy '{src}' to '{dst}': the target exists; remove it first"
            )
        source = {"Bucket": src_bucket, "Key": src_key}
        attempts = 0

        def copy() -> Any:
            nonlocal attempts
            attempts += 1
            return self.client.copy_object(
                Bucket=bucket, Key=key, CopySource=source, IfNoneMatch="*"
            )

        def copy_part(bucket: str, key: str, upload_id: str, number: int, part_size: int) -> Any:
            first = (number - 1) * part_size
            last = min(size, first + part_size) - 1
            return self.client.upload_part_copy(
                Bucket=bucket,
                Key=key,
                UploadId=upload_id,
                PartNumber=number,
                CopySource=source,
                CopySourceRange=f"bytes={first}-{last}",
            )

        try:
            if size < self.copy_threshold:
                self._call("writing", dst, copy)
            else:
                self._multipart(dst, size, False, copy_part, {})
        except CheckpointExistsError:
            if attempts > 1 and self._etag(dst) == etag:
                return  # an earlier attempt made this copy but its answer was lost
            raise CheckpointExistsError(
                f"cannot copy '{src}' to '{dst}': the target exists; remove it first"
            ) from None

    def delete_files(self, locations: Iterable[str]) -> None:
        by_bucket: dict[str, list[str]] = {}
        for location in locations:
            bucket, key = self._object(location)
            by_bucket.setdefault(bucket, []).append(key)
        for bucket, keys in by_bucket.items():
            for i in range(0, len(keys), DELETE_BATCH):
                self._delete_batch(bucket, keys[i : i + DELETE_BATCH])

    def _delete_batch(self, bucket: str, keys: list[str]) -> None:
        """One `DeleteObjects` request; keys that do not exist count as deleted (as in S3)."""
        where = f"{SCHEME}{bucket}/{keys[0]}" + (f" and {len(keys) - 1} more" if keys[1:] else "")
        answer = self._call(
            "deleting",
            where,
            lambda: self.client.delete_objects(
                Bucket=bucket,
                Delete={"Objects": [{"Key": k} for k in keys], "Quiet": True},
            ),
        )
        errors = answer.get("Errors") or []
        if errors:
            first = errors[0]
            raise StorageError(
                f"deleting {len(errors)} of {len(keys)} objects in '{SCHEME}{bucket}' failed, "
                f"e.g. '{SCHEME}{bucket}/{first.get('Key')}' ({first.get('Code')}: "
                f"{first.get('Message')}); check the credentials' s3:DeleteObject permission"
            )

    # -- plumbing ----------------------------------------------------------------------------
    def _call(self, what: str, location: str, fn: Callable[[], T]) -> T:
        """Run one request with retries of transient failures until `retry_deadline`."""
        self.client  # noqa: B018  (built before the clock starts: loading boto3 takes a while)
        return call_with_retries(what, location, fn, self.options.retry_deadline)


def _md5(source: bytes | Path) -> str:
    """Hex MD5, which S3 reports as the ETag of an object stored by one `PutObject`."""
    if isinstance(source, bytes):
        return hashlib.md5(source).hexdigest()
    digest = hashlib.md5()
    with open(source, "rb") as f:
        while chunk := f.read(8 * MiB):
            digest.update(chunk)
    return digest.hexdigest()
