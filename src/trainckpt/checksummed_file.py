"""A local file written once, with its CRC32C computed from the bytes as they go out.

Checkpoint files need a CRC32C in the manifest. Computing it while writing costs one pass over
memory that is already hot; computing it afterwards means reading every file back (from disk,
once a checkpoint outgrows the page cache). The file is fsynced once, when closed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import google_crc32c

from .records import FileEntry
from .storage.local import writing

_CRC_CHUNK = 1 << 20
"""google_crc32c accepts only `bytes`: large buffers are copied into it in chunks this big, so
the copies stay in the CPU cache and the allocator reuses their memory."""

_BUFFER = 1 << 20
"""Small writes (torch.save's headers) are buffered; large ones go straight to the kernel."""


class ChecksummedWriter:
    """Write-only, sequential file object (`write`, `tell`, `flush`) that tracks CRC32C and size.

    Enough of a file for `torch.save` and DCP's item writer. Not thread-safe: one writer thread
    per file.
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self._crc = 0
        self._size = 0

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if isinstance(data, bytes):
            self._crc = google_crc32c.extend(self._crc, data)
        else:
            for start in range(0, n, _CRC_CHUNK):
                self._crc = google_crc32c.extend(self._crc, bytes(view[start : start + _CRC_CHUNK]))
        written = 0
        while written < n:  # a large write to a regular file may be partial
            written += self._f.write(view[written:])
        self._size += n
        return n

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        self._f.flush()

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def entry(self) -> FileEntry:
        """Size and CRC32C of everything written so far."""
        return FileEntry(size=self._size, crc32c=f"{self._crc:08x}")


@contextmanager
def checksummed_file(path: Path, *, fsync: bool = True) -> Iterator[ChecksummedWriter]:
    """Create `path` (refusing an existing file), yield its writer, then flush and (unless
    `fsync=False`, for a scratch copy) fsync it.

    The caller reads `writer.entry()` after the block: by then the bytes are durable. An
    `OSError` (no space, read-only, permission) is a `StorageError` naming `path`.
    """
    with writing(path), open(path, "xb", buffering=_BUFFER) as f:
        writer = ChecksummedWriter(f)
        yield writer
        f.flush()
        if fsync:
            os.fsync(f.fileno())
