"""Google Cloud Storage (`gs://bucket/prefix`) through `google-cloud-storage`.

Every request retries 408/429/5xx and connection errors with exponential backoff and jitter, for at
most `StorageOptions.retry_deadline` seconds: the one policy of `retry.py`, run by the SDK. Uploads
send the CRC32C computed locally (real GCS refuses a body that does not match it) and compare it
with the CRC32C the server reports; create-only writes use the precondition `if_generation_match=0`,
so two writers cannot both succeed. Transfers of several files run on `StorageOptions.thread_count`
threads and the first failure raises. No exception type of the SDK leaves this module.

Credentials come from the usual Google sources (`GOOGLE_APPLICATION_CREDENTIALS`, `gcloud auth
application-default login`, the metadata server on GCE); `STORAGE_EMULATOR_HOST` points the
client at an emulator such as fake-gcs-server.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import requests
from google.api_core import exceptions as api_exceptions
from google.auth import exceptions as auth_exceptions
from google.cloud.storage import exceptions as media_exceptions
from google.cloud.storage.retry import DEFAULT_RETRY

from trainckpt.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from trainckpt.storage.base import Listing, StorageOptions, Versioned
from trainckpt.storage.checksums import (
    FileEntry,
    crc32c_bytes,
    crc32c_file,
    crc32c_from_gcs,
    crc32c_to_gcs,
)
from trainckpt.storage.remote import RemoteStorage
from trainckpt.storage.retry import RetryPolicy

if TYPE_CHECKING:
    from google.cloud.storage import Blob, Bucket, Client

log = logging.getLogger(__name__)

SCHEME = "gs://"
_EMULATOR_ENV = "STORAGE_EMULATOR_HOST"


class GCSStorage(RemoteStorage):
    """Objects in GCS buckets. One instance (and one client) per set of options and endpoint."""

    scheme = SCHEME

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        self.retry = RetryPolicy.of(options).sdk_retry(DEFAULT_RETRY)
        self.timeout = (min(30.0, options.retry_deadline), 120.0)
        """(connect, read) seconds of one request; retries go on until the deadline."""
        self._client: Client | None = None
        self._client_lock = threading.Lock()

    @classmethod
    def endpoint(cls) -> str | None:
        return os.environ.get(_EMULATOR_ENV)

    @property
    def client(self) -> Client:
        """The SDK client, created on first use (anonymous when no credentials are found)."""
        with self._client_lock:
            if self._client is None:
                self._client = _new_client(self.options.thread_count)
            return self._client

    def _blob(self, location: str) -> Blob:
        bucket, name = self.split(location)
        if not name:
            raise CheckpointNotFoundError(f"'{location}' is a bucket, not a file")
        return self._bucket(bucket).blob(name)

    def _bucket(self, bucket: str) -> Bucket:
        return self.client.bucket(bucket)

    # -- reading -----------------------------------------------------------------------------
    def list_dir(self, location: str) -> Listing:
        bucket, prefix = self.split(location)
        prefix = f"{prefix}/" if prefix else ""
        files: dict[str, int] = {}
        with _gcs_errors("listing", location, self.options):
            pages = self.client.list_blobs(
                bucket, prefix=prefix, delimiter="/", retry=self.retry, timeout=self.timeout
            )
            for blob in pages:
                if blob.name != prefix:
                    files[blob.name[len(prefix) :]] = int(blob.size or 0)
            dirs = sorted(p[len(prefix) :].rstrip("/") for p in pages.prefixes)
        return Listing(dirs=dirs, files=files)

    def list_files(self, location: str) -> dict[str, int]:
        bucket, prefix = self.split(location)
        prefix = f"{prefix}/" if prefix else ""
        with _gcs_errors("listing", location, self.options):
            return {
                blob.name[len(prefix) :]: int(blob.size or 0)
                for blob in self.client.list_blobs(
                    bucket, prefix=prefix, retry=self.retry, timeout=self.timeout
                )
                if blob.name != prefix
            }

    def size(self, location: str) -> int:
        bucket, name = self.split(location)
        if not name:
            raise CheckpointNotFoundError(f"'{location}' is a bucket, not a file")
        with _gcs_errors("reading", location, self.options):
            blob = self._bucket(bucket).get_blob(name, retry=self.retry, timeout=self.timeout)
        if blob is None:
            raise CheckpointNotFoundError(f"'{location}' does not exist")
        return int(blob.size or 0)

    def read_bytes(self, location: str, start: int = 0, end: int | None = None) -> bytes:
        if end is not None and end <= start:
            self.size(location)  # still raise for a missing file
            return b""
        whole = start == 0 and end is None
        with _gcs_errors("reading", location, self.options):
            return self._blob(location).download_as_bytes(
                start=None if whole else start,
                end=None if end is None else end - 1,
                checksum="crc32c" if whole else None,
                retry=self.retry,
                timeout=self.timeout,
            )

    # -- writing -----------------------------------------------------------------------------
    def write_bytes(
        self, location: str, data: bytes, *, overwrite: bool = True, make_parents: bool = True
    ) -> None:
        local = FileEntry(size=len(data), crc32c=crc32c_bytes(data))
        self._upload(
            location,
            local,
            overwrite,
            lambda blob, **kw: blob.upload_from_string(
                data, content_type="application/octet-stream", **kw
            ),
        )

    def upload(self, local: Path, location: str, *, overwrite: bool = True) -> None:
        entry = crc32c_file(local)
        try:
            self._upload(
                location,
                entry,
                overwrite,
                lambda blob, **kw: blob.upload_from_filename(
                    str(local), content_type="application/octet-stream", **kw
                ),
            )
        except CheckpointExistsError:
            # The SDK retries create-only uploads too; one whose answer was lost finds its own
            # object on the retry. The same bytes are as good as ours.
            if overwrite or self._entry(location) != entry:
                raise
            log.info("'%s' already holds these bytes (a retried upload); keeping it", location)

    def _entry(self, location: str) -> FileEntry | None:
        """Size and CRC32C of an object as GCS reports them; None when it is gone."""
        bucket, name = self.split(location)
        with _gcs_errors("reading", location, self.options):
            blob = self._bucket(bucket).get_blob(name, retry=self.retry, timeout=self.timeout)
        if blob is None or not blob.crc32c:
            return None
        return FileEntry(size=int(blob.size or 0), crc32c=crc32c_from_gcs(blob.crc32c))

    def read_versioned(self, location: str) -> Versioned:
        bucket, name = self.split(location)
        for _ in range(10):  # a newer generation can replace the one just looked up
            with _gcs_errors("reading", location, self.options):
                blob = self._bucket(bucket).get_blob(name, retry=self.retry, timeout=self.timeout)
            if blob is None:
                break
            try:  # that exact generation: a newer one fails this read, never mixes with it
                with _gcs_errors("reading", location, self.options):
                    data = blob.download_as_bytes(
                        if_generation_match=blob.generation,
                        retry=self.retry,
                        timeout=self.timeout,
                    )
            except (FileNotFoundError, FileExistsError):
                continue
            return Versioned(data=data, version=str(blob.generation))
        raise CheckpointNotFoundError(f"'{location}' does not exist")

    def write_versioned(self, location: str, data: bytes, *, version: str | None) -> str:
        blob = self._blob(location)
        with _gcs_errors("writing", location, self.options):
            try:
                blob.upload_from_string(
                    data,
                    content_type="application/octet-stream",
                    if_generation_match=0 if version is None else int(version),
                    retry=self.retry,
                    timeout=self.timeout,
                )
                return str(blob.generation)
            except api_exceptions.PreconditionFailed:
                pass
        current = self.read_versioned(location)  # FileNotFoundError: it is gone
        if current.data == data:  # a retry that found its own write (`data` is unique)
            return current.version
        raise CheckpointExistsError(f"'{location}' was changed by another writer")

    def copy_file(self, src: str, dst: str) -> None:
        """A server-side rewrite (as many calls as GCS needs for a large object), create-only
        (`if_generation_match=0`); the copy's CRC32C must equal the source's. Emulators that
        ignore the precondition on rewrites (fake-gcs-server) are covered by a look-up of `dst`
        first, which two racing copies can both pass."""
        source = self._blob(src)
        target = self._blob(dst)
        with _gcs_errors("reading", src, self.options):
            source.reload(retry=self.retry, timeout=self.timeout)  # NotFound: src is missing
        if self.exists(dst):
            raise CheckpointExistsError(
                f"cannot copy '{src}' to '{dst}': the target exists; remove it first"
            )
        token: str | None = None
        try:
            while True:
                with _gcs_errors("writing", dst, self.options):
                    token, _, _ = target.rewrite(
                        source,
                        token=token,
                        if_generation_match=0,
                        retry=self.retry,
                        timeout=self.timeout,
                    )
                if token is None:
                    break
        except CheckpointExistsError:
            # A retried rewrite finds its own copy; anything else there is another file.
            if self._entry(dst) != self._entry(src):
                raise CheckpointExistsError(
                    f"cannot copy '{src}' to '{dst}': the target exists; remove it first"
                ) from None
            log.info("'%s' already holds a copy of '%s' (a retried copy); keeping it", dst, src)
            return
        if target.crc32c != source.crc32c or target.size != source.size:
            raise StorageError(
                f"the server-side copy of '{src}' to '{dst}' differs from its source "
                f"(CRC32C {target.crc32c} vs {source.crc32c}); delete '{dst}' and retry"
            )

    def upload_many(self, pairs: list[tuple[Path, str]], *, overwrite: bool = True) -> None:
        self._in_parallel(lambda pair: self.upload(pair[0], pair[1], overwrite=overwrite), pairs)

    def _upload(
        self, location: str, entry: FileEntry, overwrite: bool, send: Callable[..., None]
    ) -> None:
        blob = self._blob(location)
        blob.crc32c = crc32c_to_gcs(entry.crc32c)  # real GCS refuses a body that differs
        with _gcs_errors("writing", location, self.options):
            send(
                blob,
                if_generation_match=None if overwrite else 0,
                checksum=None,  # computed above, once; compared below
                retry=self.retry,
                timeout=self.timeout,
            )
        reported = crc32c_from_gcs(blob.crc32c) if blob.crc32c else None
        if reported != entry.crc32c or int(blob.size or 0) != entry.size:
            raise StorageError(
                f"'{location}' was corrupted in transfer: sent {entry.size} bytes with CRC32C "
                f"{entry.crc32c}, GCS stored {blob.size} bytes with CRC32C {reported}; "
                "retry the save"
            )

    def delete_files(self, locations: Iterable[str]) -> None:
        def delete(location: str) -> None:
            try:
                with _gcs_errors("deleting", location, self.options):
                    self._blob(location).delete(retry=self.retry, timeout=self.timeout)
            except FileNotFoundError:
                pass

        self._in_parallel(delete, list(locations))


def _new_client(thread_count: int) -> Client:
    from google.cloud import storage

    try:
        client = storage.Client()
    except auth_exceptions.DefaultCredentialsError:
        log.warning(
            "no Google Cloud credentials found; using anonymous access (public buckets only). "
            "Set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`"
        )
        client = storage.Client.create_anonymous_client()
    # One pooled connection per transfer thread (requests keeps 10 by default).
    adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=max(10, thread_count))
    client._http.mount("https://", adapter)
    client._http.mount("http://", adapter)
    return client


@contextmanager
def _gcs_errors(what: str, location: str, options: StorageOptions) -> Iterator[None]:
    """Turn SDK and transport errors into ours: missing -> `CheckpointNotFoundError`, failed
    precondition -> `CheckpointExistsError`, anything else -> `StorageError`."""
    try:
        yield
    except api_exceptions.NotFound as e:
        if what == "writing":
            raise StorageError(
                f"cannot write '{location}': its bucket does not exist or these credentials "
                "cannot see it; create the bucket or fix the path"
            ) from e
        raise CheckpointNotFoundError(f"'{location}' does not exist") from e
    except api_exceptions.PreconditionFailed as e:
        raise CheckpointExistsError(
            f"'{location}' already exists; pass save_overwrite=True to replace it"
        ) from e
    except (api_exceptions.Forbidden, api_exceptions.Unauthorized) as e:
        raise StorageError(
            f"{what} '{location}' was refused ({e.code}): check the credentials "
            "(GOOGLE_APPLICATION_CREDENTIALS) and their permissions on the bucket"
        ) from e
    except api_exceptions.RetryError as e:
        cause = e.cause if e.cause is not None else e
        raise StorageError(
            f"{what} '{location}' failed: GCS did not answer successfully within "
            f"retry_deadline={options.retry_deadline:g}s ({type(cause).__name__}: {cause}); "
            "check that the bucket is reachable, or raise retry_deadline"
        ) from e
    except (
        api_exceptions.GoogleAPIError,
        auth_exceptions.GoogleAuthError,
        media_exceptions.InvalidResponse,
        media_exceptions.DataCorruption,
        requests.RequestException,
        ConnectionError,
        TimeoutError,
    ) as e:
        raise StorageError(
            f"{what} '{location}' failed ({type(e).__name__}: {e}); if the error is transient "
            "it was retried for up to retry_deadline"
            f"={options.retry_deadline:g}s"
        ) from e
