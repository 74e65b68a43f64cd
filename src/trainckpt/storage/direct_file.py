"""A local file written once, sequentially, past the page cache (`O_DIRECT`) where the
filesystem allows, with its CRC32C computed from the bytes as they arrive.

For bytes that are written now and read only after a failure (the local tier's replicas): going
through the page cache costs a copy into freshly allocated cache pages for every byte, competes
with the network copies for the same memory, and then evicts pages the training run uses.
`O_DIRECT` writes straight from memory to the disk: bytes that come in page-aligned pieces
(the transfer buffers) are written where they are; the rest go through one aligned buffer of
`BLOCK` bytes. The tail is written padded to the alignment, then the file is cut back to its
real size. A filesystem that refuses `O_DIRECT` (tmpfs on older kernels) gets the same
writes through the page cache. The file is fsynced once, when closed.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainckpt.storage.checksummed_file import crc32c_extend
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.local import writing

log = logging.getLogger(__name__)

BLOCK = 8 << 20
"""Bytes per write (a multiple of `ALIGN`): the one buffer a writer holds."""

ALIGN = 4096
"""Alignment of `O_DIRECT` offsets, lengths and buffer addresses (the page size covers every
logical block size in use)."""


class DirectWriter:
    """Sequential writes (`write`) into a file opened by `direct_file`; tracks size and CRC32C."""

    def __init__(self, fd: int, direct: bool) -> None:
        self._fd, self.direct = fd, direct
        self._map = mmap.mmap(-1, BLOCK)  # page-aligned: what O_DIRECT needs
        self._buf = memoryview(self._map)
        self._fill = 0
        self._crc = 0
        self._size = 0

    def write(self, data: memoryview) -> int:
        view = data.cast("B") if data.format != "B" else data
        self._crc = crc32c_extend(self._crc, view)
        done = 0
        if self._fill == 0 and _is_aligned(view):
            done = len(view) // ALIGN * ALIGN
            self._write_all(view[:done])
        while done < len(view):
            take = min(BLOCK - self._fill, len(view) - done)
            self._buf[self._fill : self._fill + take] = view[done : done + take]
            self._fill += take
            done += take
            if self._fill == BLOCK:
                self._flush(BLOCK)
        self._size += len(view)
        return len(view)

    def _flush(self, length: int) -> None:
        """Write the first `length` bytes of the buffer (a multiple of `ALIGN`)."""
        self._write_all(self._buf[:length])
        self._fill = 0

    def _write_all(self, view: memoryview) -> None:
        written = 0
        while written < len(view):
            written += os.write(self._fd, view[written:])

    def finish(self) -> None:
        """Write what is left (padded to the alignment) and cut the file to its size."""
        if self._fill:
            padded = -(-self._fill // ALIGN) * ALIGN
            self._buf[self._fill : padded] = bytes(padded - self._fill)
            self._flush(padded)
            os.ftruncate(self._fd, self._size)

    def release(self) -> None:
        self._buf.release()
        self._map.close()

    def entry(self) -> FileEntry:
        """Size and CRC32C of everything written so far."""
        return FileEntry(size=self._size, crc32c=f"{self._crc:08x}")


def _is_aligned(view: memoryview) -> bool:
    """True for a writable view whose first byte is `ALIGN`-aligned (read-only views are
    copied through the buffer: their address is not needed elsewhere)."""
    if view.readonly or len(view) < ALIGN:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0


@contextmanager
def direct_file(path: Path) -> Iterator[DirectWriter]:
    """Create `path` (refusing an existing file), yield its writer, then write the tail and
    fsync. The caller reads `writer.entry()` after the block: by then the bytes are durable.
    An `OSError` (no space, read-only, permission) is a `StorageError` naming `path`."""
    with writing(path):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        direct = getattr(os, "O_DIRECT", 0)
        try:
            fd = os.open(path, flags | direct, 0o644)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:  # this filesystem has no O_DIRECT
                raise
            log.debug("'%s': no O_DIRECT here (%s), writing through the page cache", path, e)
            fd, direct = os.open(path, flags, 0o644), 0
        writer = DirectWriter(fd, bool(direct))
        try:
            yield writer
            writer.finish()
            os.fsync(fd)
        finally:
            writer.release()
            os.close(fd)
