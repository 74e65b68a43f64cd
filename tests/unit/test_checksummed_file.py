"""The file writer behind every shard: the CRC32C it reports is the CRC32C of the bytes on disk,
whatever the sizes and kinds of buffers it was handed (read-only views from `torch.save`,
writable tensor memory, chunk boundaries), and the native in-place path agrees with
google_crc32c."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import google_crc32c
import pytest
import torch

from trainckpt.errors import StorageError
from trainckpt.storage import checksummed_file as cf
from trainckpt.storage.checksums import crc32c_file

SIZES = [0, 1, 4095, cf._BUFFER - 1, cf._BUFFER, cf._CHUNK - 1, cf._CHUNK + 1, 2 * cf._CHUNK + 7]


def test_the_native_crc32c_is_found_and_agrees_with_google_crc32c() -> None:
    assert cf._EXTEND is not None  # the wheel's library: else every large write copies
    for n in SIZES:
        data = os.urandom(n)
        for view in (memoryview(data), memoryview(bytearray(data))):  # read-only and writable
            assert cf.crc32c_extend(0x1234, view) == google_crc32c.extend(0x1234, data), n


def test_the_private_crc32c_symbol_is_there_and_called_without_the_interpreter_lock() -> None:
    """The path leans on a private symbol of google-crc32c (pinned in pyproject.toml): when a
    new version drops it, this fails, instead of every large write silently copying."""
    import ctypes

    assert google_crc32c.implementation == "c", "google-crc32c without its C extension"
    assert cf._EXTEND is not None, (
        f"google-crc32c {importlib.metadata.version('google-crc32c')} no longer exports "
        "crc32c_extend from google_crc32c._crc32c: adapt storage/checksummed_file.py or keep "
        "the pin in pyproject.toml"
    )
    # A CDLL function (not PYTHONAPI, as PyDLL's are) releases the lock for the call.
    assert not cf._EXTEND._flags_ & ctypes._FUNCFLAG_PYTHONAPI  # type: ignore[attr-defined]


def test_written_crc32c_matches_the_file_for_every_split(tmp_path: Path) -> None:
    """Writes of every size, in one file: the running CRC32C is that of the bytes on disk."""
    path = tmp_path / "f.bin"
    with cf.checksummed_file(path) as out:
        for i, n in enumerate(SIZES):
            data = os.urandom(n)
            out.write(data if i % 2 else bytearray(data))
    assert out.entry() == crc32c_file(path)
    assert out.entry().size == sum(SIZES) == path.stat().st_size


def test_torch_save_through_the_writer_loads_back_and_matches_its_crc32c(tmp_path: Path) -> None:
    """torch.save hands the writer read-only views of tensor memory, larger than a chunk."""
    tensor = torch.randn(cf._CHUNK // 4 * 2 + 5)
    path = tmp_path / "t.pt"
    with cf.checksummed_file(path) as out:
        torch.save({"t": tensor, "n": 3}, out)  # type: ignore[arg-type]
    assert out.entry() == crc32c_file(path)
    got = torch.load(path, weights_only=True)
    assert torch.equal(got["t"], tensor) and got["n"] == 3


def test_an_existing_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"keep")
    with pytest.raises(StorageError, match="exists"), cf.checksummed_file(path):
        pass
    assert path.read_bytes() == b"keep"
