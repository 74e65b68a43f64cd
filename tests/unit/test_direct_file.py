"""`storage/direct_file.py`: files written past the page cache hold exactly the bytes given,
however they were cut (aligned buffers written in place, unaligned and read-only pieces through
the block buffer, tails padded then cut back), with the CRC32C a plain read computes."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import pytest

from trainckpt.errors import CheckpointError
from trainckpt.storage.checksums import crc32c_file
from trainckpt.storage.direct_file import ALIGN, BLOCK, direct_file


def _aligned(data: bytes) -> memoryview:
    m = mmap.mmap(-1, max(len(data), 1))
    m[: len(data)] = data
    return memoryview(m)[: len(data)]


PIECES = [
    ("empty", []),
    ("one byte", [b"x"]),
    ("aligned in place, tail", ["aligned:3", "aligned:" + str(2 * BLOCK + ALIGN + 5)]),
    ("unaligned slices", ["slice:1", "slice:" + str(BLOCK), "slice:" + str(ALIGN - 1)]),
    ("read-only bytes then aligned", [b"y" * (ALIGN + 1), "aligned:" + str(BLOCK)]),
    ("aligned after buffered", ["aligned:10", "aligned:" + str(3 * ALIGN)]),
]


@pytest.mark.parametrize(("name", "pieces"), PIECES, ids=[p[0] for p in PIECES])
def test_written_bytes_and_checksum_are_exact(tmp_path: Path, name: str, pieces: list):
    rng = os.urandom(3 * BLOCK + 3 * ALIGN)
    expected = bytearray()
    path = tmp_path / "f"
    with direct_file(path) as w:
        for piece in pieces:
            if isinstance(piece, bytes):
                view: memoryview = memoryview(piece)
            else:
                kind, n = piece.split(":")
                data = rng[len(expected) : len(expected) + int(n)]
                view = (
                    _aligned(data) if kind == "aligned" else memoryview(bytearray(b"-" + data))[1:]
                )
            expected += view
            w.write(view)
    assert path.read_bytes() == bytes(expected)
    assert w.entry() == crc32c_file(path)


def test_an_existing_file_is_refused_and_named(tmp_path: Path):
    path = tmp_path / "f"
    path.write_bytes(b"old")
    with pytest.raises(CheckpointError, match=str(path)), direct_file(path):
        pass
    assert path.read_bytes() == b"old"


def test_tmpfs_without_or_with_o_direct_holds_the_same_bytes():
    path = Path("/dev/shm") / f"trainckpt-direct-{os.getpid()}"
    data = os.urandom(BLOCK + 123)
    try:
        with direct_file(path) as w:
            w.write(memoryview(data))
        assert path.read_bytes() == data
    finally:
        path.unlink(missing_ok=True)
