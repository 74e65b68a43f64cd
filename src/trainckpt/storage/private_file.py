"""A private scratch file: a file on a folder's disk with no name, that no other process opens.

The local tier restores a part by copying its bytes into such a file, computing the CRC32C of
exactly the bytes it writes there, and then loading (memory-mapping) that file: what is loaded
is what was checked, even if the part's own files change on disk meanwhile. The file is
created with `O_TMPFILE` (no name ever; it vanishes when the last descriptor or mapping goes,
also after a crash); where the filesystem has no `O_TMPFILE` it is created under a `.tmp` name
and unlinked at once (a crash in between leaves a `.tmp` leftover the local tier deletes). Only
this process (or one allowed to read its memory, e.g. root) can reach it, through
`/proc/self/fd`. Its pages live in the page cache, not in the process's anonymous memory, and
it is never fsynced: it is read right after and then dropped.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from trainckpt.storage.checksummed_file import crc32c_extend
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.local import writing


class PrivateFile:
    """An open private file: sequential `write`s (size and CRC32C tracked), `path` to load it
    by, `read_all` to read it back. Close it (or leave the `with` block) when done; a mapping
    of it stays valid after that."""

    def __init__(self, folder: Path, fallback_name: str) -> None:
        self.where = folder / fallback_name
        with writing(self.where):
            flags = os.O_RDWR | getattr(os, "O_CLOEXEC", 0)
            try:
                self.fd = os.open(folder, flags | os.O_TMPFILE, 0o600)
            except OSError as e:  # this filesystem has no O_TMPFILE: a name for an instant
                if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
                self.fd = os.open(self.where, flags | os.O_CREAT | os.O_EXCL, 0o600)
                os.unlink(self.where)
        self._crc = 0
        self._size = 0

    @property
    def path(self) -> str:
        """A path that opens this file (in this process only)."""
        return f"/proc/self/fd/{self.fd}"

    def write(self, data: memoryview) -> None:
        """Append `data`; the CRC32C is computed from `data` itself, the bytes written."""
        view = data.cast("B") if data.format != "B" else data
        self._crc = crc32c_extend(self._crc, view)
        with writing(self.where):
            done = 0
            while done < len(view):
                done += os.write(self.fd, view[done:])
        self._size += len(view)

    def entry(self) -> FileEntry:
        """Size and CRC32C of everything written."""
        return FileEntry(size=self._size, crc32c=f"{self._crc:08x}")

    def read_all(self) -> bytes:
        """The whole file (for small files, e.g. a part's trainer state)."""
        return os.pread(self.fd, self._size + 1, 0)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PrivateFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
