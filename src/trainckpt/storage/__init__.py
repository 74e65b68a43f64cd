"""Storage back ends. `storage_for` is the only place that looks at a URL scheme."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from trainckpt.storage.base import DEFAULT_OPTIONS, Listing, Storage, StorageOptions, Versioned
from trainckpt.storage.local import LocalStorage

__all__ = [
    "Listing",
    "Storage",
    "StorageOptions",
    "Versioned",
    "LocalStorage",
    "storage_for",
    "resolve",
    "default_options",
]

_LOCAL = LocalStorage()
_DEFAULT: ContextVar[StorageOptions] = ContextVar(
    "trainckpt_storage_options", default=DEFAULT_OPTIONS
)


@contextmanager
def default_options(options: StorageOptions) -> Iterator[None]:
    """Within the block (this thread's context), `storage_for` and `resolve` called without
    options use `options`: how the `trainckpt` command's `--timeout` reaches every storage
    call, the `Checkpointer` classmethods' included. Options passed explicitly still win."""
    token = _DEFAULT.set(options)
    try:
        yield
    finally:
        _DEFAULT.reset(token)


def storage_for(location: str, options: StorageOptions = DEFAULT_OPTIONS) -> Storage:
    """The back end that serves `location` (a local path, `file://`, `gs://`, `s3://`,
    `http(s)://`)."""
    if options is DEFAULT_OPTIONS:
        options = _DEFAULT.get()
    scheme = location.split("://", 1)[0].lower() if "://" in location else ""
    if scheme in ("", "file"):
        return _LOCAL
    if scheme == "gs":
        from trainckpt.storage.gcs import GCSStorage

        return GCSStorage.shared(options)
    if scheme in ("http", "https"):
        from trainckpt.storage.http import HTTPStorage

        return HTTPStorage.shared(options)
    if scheme == "s3":
        from trainckpt.storage.s3 import S3Storage

        return S3Storage.shared(options)
    from trainckpt.errors import ConfigurationError

    raise ConfigurationError(
        f"'{location}': unsupported storage scheme '{scheme}://'; "
        "use a local path, file://, gs://, s3:// or http(s)://"
    )


def resolve(
    location: str | object, options: StorageOptions = DEFAULT_OPTIONS
) -> tuple[Storage, str]:
    """The back end for `location` and the location in that back end's canonical form."""
    loc = str(location)
    storage = storage_for(loc, options)
    return storage, storage.normalize(loc)
