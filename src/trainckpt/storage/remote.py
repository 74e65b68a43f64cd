"""What the URL back ends (GCS, S3, HTTP) share: one cached instance per options and endpoint,
bucket/key splitting, byte-range reads and cached-path downloads."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, TypeVar, cast

from trainckpt.errors import StorageError
from trainckpt.storage.base import Storage, StorageOptions
from trainckpt.storage.download import cached_copy
from trainckpt.storage.ranged import RangeReader

R = TypeVar("R", bound="RemoteStorage")


class RemoteStorage(Storage):
    """Base of the back ends addressed by URL. Subclasses set `scheme` (e.g. `"gs://"`)."""

    atomic_rename = False
    scheme: ClassVar[str]

    _instances: ClassVar[dict[tuple[Any, ...], RemoteStorage]] = {}
    _instances_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, options: StorageOptions) -> None:
        self.options = options

    @classmethod
    def endpoint(cls) -> str | None:
        """The endpoint the environment points this back end at (e.g. an emulator); a change
        gets a new instance, and with it a new client."""
        return None

    @classmethod
    def shared(cls: type[R], options: StorageOptions) -> R:
        """The instance for `options` and the current `endpoint()`."""
        key = (cls, options, cls.endpoint())
        with cls._instances_lock:
            if key not in cls._instances:
                cls._instances[key] = cls(options)
            return cast(R, cls._instances[key])

    def normalize(self, location: str) -> str:
        bucket, key = self.split(location)
        return f"{self.scheme}{bucket}/{key}" if key else f"{self.scheme}{bucket}"

    def join(self, base: str, *parts: str) -> str:
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts if p)])

    def parent(self, location: str) -> str:
        bucket, key = self.split(location)
        return self.normalize(f"{self.scheme}{bucket}/{key.rpartition('/')[0]}")

    def split(self, location: str) -> tuple[str, str]:
        """`gs://bucket/a/b` -> (`bucket`, `a/b`)."""
        if not location.startswith(self.scheme):
            raise StorageError(f"'{location}' is not a {self.scheme} URL")
        bucket, _, key = location[len(self.scheme) :].partition("/")
        if not bucket:
            raise StorageError(f"'{location}' names no bucket; use {self.scheme}bucket/prefix")
        return bucket, key.strip("/")

    def open_read(self, location: str) -> BinaryIO:
        reader = RangeReader(
            location, self.size(location), lambda s, e: self.read_bytes(location, s, e)
        )
        return cast(BinaryIO, reader)

    def local_copy(self, location: str, cache_dir: Path) -> Path:
        return cached_copy(location, cache_dir)

    def copy_many(self, pairs: list[tuple[str, str]]) -> None:
        self._in_parallel(lambda pair: self.copy_file(*pair), pairs)

    def _in_parallel(self, fn: Callable[[Any], None], items: list[Any]) -> None:
        """Run `fn` on every item on `thread_count` threads; the first error raises (and the
        items not yet started are dropped)."""
        if len(items) <= 1:
            for item in items:
                fn(item)
            return
        name = f"trainckpt-{type(self).__name__}"
        pool = ThreadPoolExecutor(min(self.options.thread_count, len(items)), name)
        try:
            futures = [pool.submit(fn, item) for item in items]
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            for f in futures:
                if f in done and f.exception() is not None:
                    raise cast(BaseException, f.exception())
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
