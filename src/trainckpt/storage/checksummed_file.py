"""A local file written once, with its CRC32C computed from the bytes as they go out.

Checkpoint files need a CRC32C in the manifest. Computing it while writing costs one pass over
memory that is already hot; computing it afterwards means reading every file back (from disk,
once a checkpoint outgrows the page cache). The file is fsynced once, when closed.

The writer often runs on a background thread while training goes on (`save_async`), so it
holds the interpreter lock as little as it can: large writes are cut into chunks of `_CHUNK`
bytes, and for each the CRC32C (read in place, without the lock) and the `write` (the kernel
call, without the lock) are the only work; the chunk is still in the CPU cache for the second
pass.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import google_crc32c

from trainckpt.storage.checksums import FileEntry, crc32c_combine
from trainckpt.storage.local import writing

_CHUNK = 8 << 20
"""Large writes go out in chunks this big: each is CRC'd and written while it is in the CPU
cache, and the training thread gets the interpreter lock between chunks."""

_BUFFER = 1 << 20
"""Small writes (torch.save's headers) are buffered; large ones go straight to the kernel."""

_COMBINE_FROM = 4 << 20
"""A chunk of a part this large is CRC'd once and combined into the file's CRC32C: the
combination (a few GF(2) products in Python, holding the interpreter lock) costs less than a
second pass over this many bytes."""


class _PyBuffer(ctypes.Structure):
    """CPython's `Py_buffer`: how to get the address of any buffer, read-only ones too."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


def _native_extend() -> Callable[[int, int, int], int] | None:
    """`crc32c_extend(crc, address, size)` of the crc32c library that google_crc32c's C
    extension links, called through ctypes: it reads the bytes in place, and ctypes releases
    the interpreter lock for the call. (google_crc32c's own `extend` wants `bytes`, which means
    a copy made while holding the lock.) None when only its pure-Python version is installed.

    Private: google-crc32c offers no public call that reads a buffer in place without the lock,
    so pyproject.toml pins the versions whose extension exports this symbol, and
    tests/unit/test_checksummed_file.py fails loudly if it disappears (docs/storage.md)."""
    try:
        from google_crc32c import _crc32c  # type: ignore[attr-defined]

        fn = ctypes.CDLL(_crc32c.__file__).crc32c_extend
        get, release = ctypes.pythonapi.PyObject_GetBuffer, ctypes.pythonapi.PyBuffer_Release
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    fn.restype = ctypes.c_uint32
    get.argtypes = (ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int)
    get.restype = ctypes.c_int
    release.argtypes = (ctypes.POINTER(_PyBuffer),)
    release.restype = None
    probe = ctypes.create_string_buffer(b"123456789", 9)
    if fn(0, ctypes.addressof(probe), 9) != 0xE3069283:  # the standard check value
        return None  # not the function it is named after: use the safe path
    return fn


_EXTEND = _native_extend()


@contextmanager
def _address(view: memoryview) -> Iterator[int]:
    """The address of a contiguous buffer's first byte, valid inside the block."""
    buf = _PyBuffer()
    if ctypes.pythonapi.PyObject_GetBuffer(ctypes.py_object(view), ctypes.byref(buf), 0) != 0:
        raise BufferError("cannot address the buffer")
    try:
        yield int(buf.buf or 0)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(buf))


def buffer_address(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte (valid while what it views lives)."""
    with _address(view) as address:
        return address


def crc32c_extend(crc: int, view: memoryview) -> int:
    """The CRC32C `crc` extended by the bytes of `view` (a contiguous byte view). Large views
    are read in place without the interpreter lock when the native library is there."""
    if _EXTEND is None or len(view) < _BUFFER:
        return google_crc32c.extend(crc, bytes(view))
    with _address(view) as address:
        return _EXTEND(crc, address, len(view))


class ChecksummedWriter:
    """Write-only, sequential file object (`write`, `tell`, `flush`) that tracks CRC32C and size,
    of the whole file and of the part written since `start_part()` (until `part()`).

    Enough of a file for `torch.save` and DCP's item writer. Every byte is read once for its
    checksums: outside a part only the file's CRC32C is extended; inside one, a large chunk's
    CRC32C is computed once and combined into both (`crc32c_combine`), a small one's extends
    both. Not thread-safe: one writer thread per file.
    """

    def __init__(self, f: Any) -> None:
        self._f = f
        self._crc = 0
        self._size = 0
        self._part_crc = 0
        self._part_start = 0
        self._in_part = False

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        for start in range(0, n, _CHUNK):
            chunk = view[start : start + _CHUNK]
            if not self._in_part:
                self._crc = crc32c_extend(self._crc, chunk)
            elif len(chunk) >= _COMBINE_FROM:
                crc = crc32c_extend(0, chunk)
                self._crc = crc32c_combine(self._crc, crc, len(chunk))
                fresh = self._size + start == self._part_start
                self._part_crc = crc if fresh else crc32c_combine(self._part_crc, crc, len(chunk))
            else:
                self._crc = crc32c_extend(self._crc, chunk)
                self._part_crc = crc32c_extend(self._part_crc, chunk)
            written = 0
            while written < len(chunk):  # a large write to a regular file may be partial
                written += self._f.write(chunk[written:])
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

    def start_part(self) -> None:
        """Start a new part (a DCP item): `part()` then covers what is written from here."""
        self._part_crc, self._part_start, self._in_part = 0, self._size, True

    def part(self) -> tuple[int, int, int]:
        """Offset, length and CRC32C of the part written since `start_part()`, which ends it."""
        self._in_part = False
        return self._part_start, self._size - self._part_start, self._part_crc

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
