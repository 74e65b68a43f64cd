"""Read-only `http://` and `https://` URLs: published checkpoints loaded from a web server.

Files are read with HEAD (size) and ranged GETs, so DCP fetches only the slices it needs;
`local_copy` goes through cached-path (keyed by the server's ETag). A web server cannot list a
folder, so the finders refuse HTTP folders (`supports_listing = False`) and writes are refused.
Requests retry 408/429/5xx and connection errors with backoff until `retry_deadline`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import requests

from trainckpt.errors import CheckpointNotFoundError, ConfigurationError, StorageError
from trainckpt.storage.base import Listing, Storage, StorageOptions
from trainckpt.storage.remote import RemoteStorage

_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_HEAD_REFUSED = frozenset({403, 405, 501})


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

    # -- reading -----------------------------------------------------------------------------
    def list_dir(self, location: str) -> Listing:
        raise self._no_listing(location)

    def list_files(self, location: str) -> dict[str, int]:
        raise self._no_listing(location)

    def size(self, location: str) -> int:
        head = self._request("HEAD", location, passthrough=_HEAD_REFUSED)
        length = head.headers.get("Content-Length") if head.status_code < 400 else None
        if length is not None:
            return int(length)
        # A server that refuses HEAD or omits the length (signed URLs, some CDNs): ask for the
        # first byte; the total size is in Content-Range.
        probe = self._request("GET", location, {"Range": "bytes=0-0"})
        total = probe.headers.get("Content-Range", "").rpartition("/")[2]
        if probe.status_code == 206 and total.isdigit():
            return int(total)
        if probe.status_code == 200:
            return len(probe.content)
        raise StorageError(
            f"'{location}': the server reports no size (no Content-Length on HEAD, no "
            "Content-Range on a ranged GET); serve the checkpoint from a static file server"
        )

    def read_bytes(self, location: str, start: int = 0, end: int | None = None) -> bytes:
        if end is not None and end <= start:
            self.size(location)
            return b""
        headers = {}
        if start or end is not None:
            headers["Range"] = f"bytes={start}-{'' if end is None else end - 1}"
        response = self._request("GET", location, headers)
        if response.status_code == 206:
            return response.content
        if response.status_code == 416:  # range starts past the end
            return b""
        return response.content[start:end]  # a server that ignores Range sends everything

    def _request(
        self,
        method: str,
        url: str,
        headers: dict[str, str] | None = None,
        passthrough: frozenset[int] = frozenset(),
    ) -> requests.Response:
        """One request, retried with backoff on 408/429/5xx and connection errors until
        `retry_deadline`; 404 raises `CheckpointNotFoundError`, other failures `StorageError`
        (statuses in `passthrough` are returned to the caller instead)."""
        deadline = time.monotonic() + self.options.retry_deadline
        delay = 0.25
        while True:
            try:
                response = self.session.request(
                    method, url, headers=headers, timeout=self.timeout, allow_redirects=True
                )
                problem = f"HTTP {response.status_code}"
            except (requests.ConnectionError, requests.Timeout) as e:
                response, problem = None, f"{type(e).__name__}: {e}"
            if response is not None and (
                response.status_code not in _RETRY_STATUS or response.status_code in passthrough
            ):
                break
            if time.monotonic() + delay > deadline:
                raise StorageError(
                    f"{method} '{url}' failed ({problem}) and kept failing for "
                    f"retry_deadline={self.options.retry_deadline:g}s; check that the server "
                    "is reachable, or raise retry_deadline"
                )
            time.sleep(delay)  # backoff between retries
            delay = min(delay * 2, 10.0)
        if response.status_code in passthrough:
            return response
        if response.status_code in (404, 410):
            raise CheckpointNotFoundError(f"'{url}' does not exist (HTTP {response.status_code})")
        if response.status_code >= 400 and response.status_code != 416:
            raise StorageError(
                f"{method} '{url}' failed with HTTP {response.status_code}; check the URL and "
                "that the server allows access"
            )
        return response

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
