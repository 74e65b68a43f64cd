"""The storage interface: where checkpoint bytes live, separate from what is written.

A `Storage` works on locations in its own form (a local path for `LocalStorage`, a URL for the
remote ones). Nothing outside `trainckpt.storage` parses URL schemes; callers get a back end from
`trainckpt.storage.storage_for(location)`.

Errors: a missing location raises `FileNotFoundError` (ours: `CheckpointNotFoundError`); a
create-only write onto an existing location raises `FileExistsError` (`CheckpointExistsError`);
anything else the back end cannot do raises `StorageError`. No SDK exception type escapes.

Rank roles: every method is local to the calling process; the commit protocol (`commit.py`)
decides which ranks call what.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from trainckpt.testing.faults import fault_point


@dataclass(frozen=True)
class StorageOptions:
    """Knobs a `CheckpointerConfig` passes to remote back ends (local storage ignores them)."""

    thread_count: int = 8
    """Parallel transfers per process."""
    retry_deadline: float = 300.0
    """Seconds a request may keep retrying (408/429/5xx, connection errors) before failing."""


DEFAULT_OPTIONS = StorageOptions()


@dataclass(frozen=True)
class Versioned:
    """A small file's bytes and the version the store gave them (a GCS generation, an S3
    ETag): what a compare-and-swap write (`Storage.write_versioned`) must name."""

    data: bytes
    version: str


@dataclass(frozen=True)
class Listing:
    """Immediate children of a folder: sub-folder names and file names with sizes."""

    dirs: list[str]
    files: dict[str, int]


class Storage(ABC):
    """One back end. Instances are cheap, thread-safe and hold no per-checkpoint state."""

    atomic_rename: bool = False
    """True when a folder can be renamed atomically (local and NFS): saves then write into a
    `<dir>-tmp` folder and rename it. False for object stores: files go straight to `<dir>/`
    and the commit record, uploaded last, is the commit."""

    writable: bool = True
    """False for read-only back ends (HTTP)."""

    supports_listing: bool = True
    """False where a folder cannot be listed (HTTP): finders refuse with a clear error."""

    # -- paths -------------------------------------------------------------------------------
    @abstractmethod
    def join(self, base: str, *parts: str) -> str:
        """`base` with relative `parts` appended, `/`-separated."""

    def normalize(self, location: str) -> str:
        """Canonical form of `location` (no trailing slash, `file://` stripped for local)."""
        return location.rstrip("/") or location

    def parent(self, location: str) -> str:
        return location.rstrip("/").rsplit("/", 1)[0]

    def name(self, location: str) -> str:
        return location.rstrip("/").rsplit("/", 1)[-1]

    # -- reading -----------------------------------------------------------------------------
    @abstractmethod
    def list_dir(self, location: str) -> Listing:
        """Immediate children of `location` in one listing. A missing folder raises
        `FileNotFoundError` (object stores: an empty prefix gives an empty listing)."""

    @abstractmethod
    def list_files(self, location: str) -> dict[str, int]:
        """Every file below `location`, as `/`-separated relative path -> size."""

    @abstractmethod
    def size(self, location: str) -> int:
        """Size of one file; `FileNotFoundError` when it does not exist."""

    def exists(self, location: str) -> bool:
        """True when `location` is a file."""
        try:
            self.size(location)
        except FileNotFoundError:
            return False
        return True

    @abstractmethod
    def read_bytes(self, location: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes `[start, end)` of a file (the whole file by default)."""

    @abstractmethod
    def open_read(self, location: str) -> BinaryIO:
        """A seekable binary reader; remote back ends read byte ranges on demand."""

    @abstractmethod
    def local_copy(self, location: str, cache_dir: Path) -> Path:
        """A local path holding the file's bytes: the file itself when local, else a copy
        downloaded into `cache_dir` (through cached-path for URLs)."""

    # -- writing -----------------------------------------------------------------------------
    @abstractmethod
    def write_bytes(
        self, location: str, data: bytes, *, overwrite: bool = True, make_parents: bool = True
    ) -> None:
        """Write a whole file atomically and durably: readers see the old bytes or the new,
        never a part. With `overwrite=False` an existing file raises `FileExistsError` and is
        left as it was (a precondition on object stores, not a check-then-write). On a
        filesystem, missing parent folders are created unless `make_parents=False`; then a
        missing folder raises `FileNotFoundError` (a commit record is never written into a
        recreated copy of a folder deleted under a save). Object stores have no folders."""

    @abstractmethod
    def upload(self, local: Path, location: str, *, overwrite: bool = True) -> None:
        """Copy a local file to `location`, durably, with the same rules as `write_bytes`;
        a create-only upload onto a file holding these very bytes (size and CRC32C) may count
        as done (a retried request finding its own earlier attempt)."""

    # -- compare-and-swap of small files (object stores: claims, `claim.py`) --------------------
    def read_versioned(self, location: str) -> Versioned:
        """A small file's bytes and version; `FileNotFoundError` when it does not exist."""
        raise NotImplementedError(f"{type(self).__name__} has no versioned files")

    def write_versioned(self, location: str, data: bytes, *, version: str | None) -> str:
        """Write a small file only if it is still at `version` (None: only if it does not
        exist), atomically on the store's side; return the new version. A file that changed
        (or, with None, exists) raises `FileExistsError`; one that is gone `FileNotFoundError`.
        `data` must differ from every earlier write of `location` (an S3 version is a hash of
        the bytes), which also lets a retried request recognise its own lost success."""
        raise NotImplementedError(f"{type(self).__name__} has no versioned files")

    @abstractmethod
    def copy_file(self, src: str, dst: str) -> None:
        """Copy file `src` to `dst` (both in this back end), create-only: an existing `dst`
        raises `FileExistsError` and is left as it was; a missing `src` `FileNotFoundError`.
        No byte passes through this process where the store can avoid it: a hard link on a
        filesystem (a byte copy where links are refused), a server-side copy on object stores.
        Checkpoint files are never changed after they are written, so a link is a copy."""

    def copy_many(self, pairs: list[tuple[str, str]]) -> None:
        """`copy_file` of several (src, dst) pairs (in parallel where the back end can); the
        first error raises."""
        for src, dst in pairs:
            self.copy_file(src, dst)

    def upload_many(self, pairs: list[tuple[Path, str]], *, overwrite: bool = True) -> None:
        """Upload several files (in parallel where the back end can); the first error raises."""
        for local, location in pairs:
            self.upload(local, location, overwrite=overwrite)

    @abstractmethod
    def delete_files(self, locations: Iterable[str]) -> None:
        """Delete files; missing ones are ignored."""

    def delete_tree(self, location: str, first: Iterable[str] = ()) -> None:
        """Delete a folder and everything below it. Files named in `first` (relative to
        `location`) go before the rest, so a commit record disappears before the data it
        vouches for. A missing folder is ignored."""
        first = [self.join(location, f) for f in first]
        self.delete_files(first)
        fault_point("during-delete")
        try:
            rest = self.list_files(location)
        except FileNotFoundError:
            return
        self.delete_files(self.join(location, rel) for rel in rest)
        self._remove_empty_dirs(location)

    def _remove_empty_dirs(self, location: str) -> None:  # noqa: B027 (optional hook)
        """Remove folders left empty by `delete_tree` (nothing to do on object stores)."""

    # -- local folders (only where `atomic_rename`) ------------------------------------------
    def local_path(self, location: str) -> Path:
        """The local path of `location`. Only back ends with `atomic_rename` have one."""
        raise NotImplementedError(f"{type(self).__name__} has no local paths")

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomically rename folder `src` to `dst` (which must not exist), durably."""
        raise NotImplementedError(f"{type(self).__name__} cannot rename folders")
