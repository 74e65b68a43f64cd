"""Read-only `http://` and `https://` URLs: published checkpoints loaded from a web server.

Files are read with HEAD (size) and ranged GETs, so DCP fetches only the slices it needs;
`local_copy` goes through cached-path (keyed by the server's ETag). A web server cannot list a
folder, so the finders refuse HTTP folders (`supports_listing = False`) and writes are refused.
Requests retry 408/429/5xx and connection errors by the one policy of `storage/retry.py`.

Bodies are streamed and read in bounded chunks, never more than the bytes asked for: a server
that ignores `Range` and answers a 100-byte request with the whole 1 GiB file costs 100 bytes of
memory (its connection is closed after them). A reader from `open_read` keeps such a whole-file
answer open and reads on in it when the next read follows, so reading a file front to back
(`verify --deep`) downloads it once, not once per chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar, cast

import requests

from trainckpt.errors import CheckpointNotFoundError, ConfigurationError, StorageError
from trainckpt.storage.base import Listing, Storage, StorageOptions
from trainckpt.storage.ranged import RangeReader
from trainckpt.storage.remote import RemoteStorage
from trainckpt.storage.retry import RETRY_STATUS, RetryPolicy

_HEAD_REFUSED = frozenset({403, 405, 501})
_CHUNK = 1024 * 1024
"""Bytes taken from a response body at a time."""
_TRANSIENT = (
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
)
"""What a request, or the reading of its streamed body, raises when the connection breaks."""

T = TypeVar("T")


class _RetryStatus(Exception):
    """An answer whose status is in `RETRY_STATUS`: the request is tried again."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")


def _is_transient(e: Exception) -> bool:
    return isinstance(e, (_RetryStatus, *_TRANSIENT))


class _Body:
    """A streamed response body, read forward in chunks of at most `_CHUNK` bytes; `pos` is
    the offset in the file of its next byte."""

    def __init__(self, response: requests.Response, pos: int) -> None:
        self.response = response
        self.pos = pos
        self._chunks: Iterator[bytes] = response.iter_content(_CHUNK)
        self._left = memoryview(b"")

    def read(self, n: int | None) -> bytes:
        """The next `n` bytes (all that is left when None; fewer at the end of the body)."""
        parts = []
        while n is None or n > 0:
            piece = self._next(n)
            if not piece:
                break
            parts.append(piece)
            n = None if n is None else n - len(piece)
        return b"".join(parts)

    def skip(self, n: int) -> None:
        """Drop the next `n` bytes, a chunk at a time."""
        while n > 0 and (piece := self._next(n)):
            n -= len(piece)

    def _next(self, most: int | None) -> memoryview:
        if not self._left:
            self._left = memoryview(next(self._chunks, b""))
        piece = self._left if most is None else self._left[:most]
        self._left = self._left[len(piece) :]
        self.pos += len(piece)
        return piece

    def close(self) -> None:
        self.response.close()


class HTTPStorage(RemoteStorage):
    """Files served over HTTP(S); read-only, no listing."""

    scheme = "http(s)://"
    normalize = Storage.normalize  # no buckets: a URL is kept as it is, less a trailing slash
    parent = Storage.parent
    writable = False
    supports_listing = False

    def __init__(self, options: StorageOptions) -> None:
        super().__init__(options)
        self.session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_maxsize=max(10, options.thread_count))
        self.session.mount("http://", adapter)
        self.session.mount("https://", adapter)
        self.timeout = (min(30.0, options.retry_deadline), 120.0)
        self.retry = RetryPolicy.of(options)

    # -- reading -----------------------------------------------------------------------------
    def list_dir(self, location: str) -> Listing:
        raise self._no_listing(location)

    def list_files(self, location: str) -> dict[str, int]:
        raise self._no_listing(location)

    def size(self, location: str) -> int:
        head = self._request("HEAD", location, _closed, passthrough=_HEAD_REFUSED)
        length = head.headers.get("Content-Length") if head.status_code < 400 else None
        if length is not None:
            return int(length)
        # A server that refuses HEAD or omits the length (signed URLs, some CDNs): ask for the
        # first byte; the total size is in Content-Range.
        size = self._request("GET", location, _probed_size, {"Range": "bytes=0-0"})
        if size is not None:
            return size
        raise StorageError(
            f"'{location}': the server reports no size (no Content-Length on HEAD, no "
            "Content-Range on a ranged GET); serve the checkpoint from a static file server"
        )

    def read_bytes(self, location: str, start: int = 0, end: int | None = None) -> bytes:
        if end is not None and end <= start:
            self.size(location)
            return b""

        def take(body: _Body | None) -> bytes:  # None: the range starts past the end
            return b"" if body is None else _read_on(body, start, end)

        return self._get_range(location, start, end, take, keep=False)

    def open_read(self, location: str) -> BinaryIO:
        fetch = _ForwardFetch(self, location)
        return cast(BinaryIO, RangeReader(location, self.size(location), fetch, fetch.close))

    def _get_range(
        self,
        location: str,
        start: int,
        end: int | None,
        consume: Callable[[_Body | None], T],
        *,
        keep: bool,
    ) -> T:
        """GET bytes `[start, end)` of `location` and hand the streamed body (None for HTTP
        416, a range past the end; the whole file from a server that ignores `Range`) to
        `consume`, within the retries; the body is closed after, or with `keep` on an error
        only (the caller then owns it)."""
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"

        def read(response: requests.Response) -> T:
            if response.status_code == 416:
                response.close()
                return consume(None)
            body = _Body(response, start if response.status_code == 206 else 0)
            try:
                result = consume(body)
            except BaseException:
                body.close()
                raise
            if not keep:
                body.close()
            return result

        return self._request("GET", location, read, headers)

    def _request(
        self,
        method: str,
        url: str,
        consume: Callable[[requests.Response], T],
        headers: dict[str, str] | None = None,
        passthrough: frozenset[int] = frozenset(),
    ) -> T:
        """One request, its body streamed, and `consume(response)`, retried together with
        backoff on 408/429/5xx and connection errors (also while the body is read) until
        `retry_deadline`. 404 raises `CheckpointNotFoundError`, other failures `StorageError`;
        statuses in `passthrough` go to `consume` instead. `consume` closes the response (or
        hands it on); it is closed for it when a retry follows. Retries: `storage/retry.py`."""

        def attempt() -> T:
            response = self.session.request(
                method,
                url,
                headers=headers,
                timeout=self.timeout,
                allow_redirects=True,
                stream=True,
            )
            try:
                if response.status_code in passthrough:
                    return consume(response)
                if response.status_code in RETRY_STATUS:
                    raise _RetryStatus(response.status_code)
                self._raise_for_status(method, url, response)
                return consume(response)
            except (_RetryStatus, *_TRANSIENT):
                response.close()
                raise

        def gave_up(last: Exception, attempts: int) -> StorageError:
            problem = (
                str(last) if isinstance(last, _RetryStatus) else f"{type(last).__name__}: {last}"
            )
            return StorageError(
                f"{method} '{url}' failed ({problem}) and kept failing for "
                f"retry_deadline={self.options.retry_deadline:g}s ({attempts} attempts); check "
                "that the server is reachable, or raise retry_deadline"
            )

        return self.retry.call(attempt, _is_transient, gave_up, f"{method} '{url}'")

    @staticmethod
    def _raise_for_status(method: str, url: str, response: requests.Response) -> None:
        """404/410: `CheckpointNotFoundError`; another error status (416 aside): `StorageError`."""
        status = response.status_code
        if status < 400 or status == 416:
            return
        response.close()
        if status in (404, 410):
            raise CheckpointNotFoundError(f"'{url}' does not exist (HTTP {status})")
        raise StorageError(
            f"{method} '{url}' failed with HTTP {status}; check the URL and that the server "
            "allows access"
        )

    # -- writing: refused ----------------------------------------------------------------------
    def write_bytes(
        self, location: str, data: bytes, *, overwrite: bool = True, make_parents: bool = True
    ) -> None:
        raise self._read_only(location)

    def upload(self, local: Path, location: str, *, overwrite: bool = True) -> None:
        raise self._read_only(location)

    def delete_files(self, locations: Iterable[str]) -> None:
        for location in locations:
            raise self._read_only(location)

    def copy_file(self, src: str, dst: str) -> None:
        raise self._read_only(dst)

    @staticmethod
    def _read_only(location: str) -> ConfigurationError:
        return ConfigurationError(
            f"cannot write to '{location}': http(s):// URLs are read-only; save to a local "
            "folder or a gs:// bucket instead"
        )

    @staticmethod
    def _no_listing(location: str) -> ConfigurationError:
        return ConfigurationError(
            f"'{location}' cannot be listed: an http(s):// server does not list folders; pass "
            "the URL of one checkpoint (e.g. .../step1000) instead of a folder of checkpoints"
        )


def _closed(response: requests.Response) -> requests.Response:
    """The response, its connection released (its status and headers are all that is used)."""
    response.close()
    return response


def _probed_size(response: requests.Response) -> int | None:
    """The file's size from the answer to a GET of its first byte (None when it says none)."""
    try:
        total = response.headers.get("Content-Range", "").rpartition("/")[2]
        if response.status_code == 206 and total.isdigit():
            return int(total)
        if response.status_code != 200:
            return None
        length = response.headers.get("Content-Length")  # the whole file: Range ignored
        if length is not None:
            return int(length)
        body, size = _Body(response, 0), 0
        while piece := body.read(_CHUNK):  # counted, not kept
            size += len(piece)
        return size
    finally:
        response.close()


class _ForwardFetch:
    """The fetch of an `open_read` reader: a ranged GET per read, except that when the server
    ignored `Range` and sent the whole file, its body is kept open and the next read that
    starts at or after its position reads on in it (skipping forward) instead of asking for
    the whole file again. Used by one reader, so by one thread at a time."""

    def __init__(self, storage: HTTPStorage, location: str) -> None:
        self.storage, self.location = storage, location
        self._kept: _Body | None = None

    def __call__(self, start: int, end: int) -> bytes:
        kept = self._kept
        if kept is not None and kept.pos <= start:
            try:
                return _read_on(kept, start, end)
            except _TRANSIENT:  # the kept connection broke: ask again, with retries
                pass
        self.close()
        return self.storage._get_range(
            self.location, start, end, lambda body: self._first(body, start, end), keep=True
        )

    def _first(self, body: _Body | None, start: int, end: int) -> bytes:
        if body is None:
            return b""
        data = _read_on(body, start, end)
        if body.response.status_code == 200:  # Range ignored: read on in it next time
            self._kept = body
        else:
            body.close()
        return data

    def close(self) -> None:
        if self._kept is not None:
            self._kept.close()
            self._kept = None


def _read_on(body: _Body, start: int, end: int | None) -> bytes:
    """Bytes `[start, end)` of the file from `body`, which is at or before `start`."""
    body.skip(start - body.pos)
    return body.read(None if end is None else end - start)
