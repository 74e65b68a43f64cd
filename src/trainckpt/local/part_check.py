"""Checking a local-tier part before it is loaded: a private copy of it (check what you copy),
each file's CRC32C computed from exactly the bytes written into the copy and compared with the
part's record, and the checked copy's states read back. Nothing read is ever unpickled but by
`load_torch_plain`."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

import google_crc32c

from trainckpt.core.cuda_calls import CudaCalls
from trainckpt.core.trainer_tensors import on_rank_device
from trainckpt.errors import CorruptCheckpointError
from trainckpt.format.safe_unpickle import load_torch_plain
from trainckpt.format.trainer_state import deserialize_trainer_state
from trainckpt.local.layout import (
    MODULE_FILE,
    PART_FILE,
    PART_FILES,
    TRAIN_FILE,
    LocalPart,
    read_local_record,
)
from trainckpt.local.part_read import PartReader, Splitter
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.private_file import PrivateFile


class PrivateCopy:
    """A part's files copied into private files (`storage/private_file.py`) in the attempt
    folder, each file's CRC32C computed from exactly the bytes written into it and checked
    against the part's record when the copy is closed. Loading from it loads what was checked,
    whatever happens to the part's own files meanwhile (check what you copy). A sink of
    `exchange` (a copy received from a holder), or filled from the own copy (`copy_own`)."""

    def __init__(self, folder: Path, part: LocalPart, source: str) -> None:
        self.part, self._split = part, Splitter(part)
        self.source = source  # the part copied, for messages
        owner = f"rank{part.owner}"
        self.files = {
            name: PrivateFile(folder, f"{owner}.{name}.restore.tmp") for name in PART_FILES
        }
        self.checked = False

    def write(self, data: memoryview) -> None:
        for name, piece, _done in self._split.pieces(data):
            self.files[name].write(piece)

    def close(self) -> None:
        """Check every file against the record (`CorruptCheckpointError` naming it)."""
        if self.checked:
            return
        for name in PART_FILES:
            where = f"'{name}' of {self.source}, as copied for the restore"
            check_entry(self.files[name].entry(), self.part.files[name], where)
        self.checked = True

    def drop(self) -> None:
        """Free the files (a failed copy)."""
        for f in self.files.values():
            f.close()

    def __enter__(self) -> PrivateCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()


_COPY_CHUNK = 8 << 20
"""Bytes per read when copying the own part into its private copy."""


def copy_own(folder: Path, files: ExitStack) -> PrivateCopy:
    """A checked private copy of the part in `folder` (read in chunks of `_COPY_CHUNK`, each
    CRC'd as it is written to the copy); `FileNotFoundError` when there is no part there, a
    `CorruptCheckpointError` naming the file when a byte differs from the record. The copy is
    closed with `files`."""
    if not (folder / PART_FILE).exists():
        raise FileNotFoundError(folder / PART_FILE)
    part = read_local_record(folder / PART_FILE, LocalPart)
    copy = files.enter_context(PrivateCopy(folder.parent, part, f"'{folder}'"))
    source = PartReader(folder, part)
    buf = memoryview(bytearray(min(_COPY_CHUNK, max(part.size, 1))))
    try:
        while got := source.readinto(buf):
            copy.write(buf[:got])
        copy.close()
    except BaseException:
        copy.drop()  # its disk space is free again at once
        raise
    finally:
        source.close()
    return copy


def load_part(copy: PrivateCopy) -> tuple[dict[str, Any], dict[str, Any]]:
    """The module state and trainer state of a checked private copy: the module file
    memory-mapped (its tensors are views of the copy's pages, so a part of any size needs no
    memory of its size until it is copied into the module), the small trainer file read and
    checked once more as the bytes that are unpickled."""
    where = f"'{MODULE_FILE}' of {copy.source}, as copied and checked"
    state = load_torch_plain(Path(copy.files[MODULE_FILE].path), where)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where} holds no state dict")
    data = copy.files[TRAIN_FILE].read_all()
    train_where = f"'{TRAIN_FILE}' of {copy.source}, as copied and checked"
    _check(data, copy.part.files[TRAIN_FILE], train_where)
    return state, deserialize_trainer_state(data, train_where, on_rank_device(CudaCalls()))


def _check(data: bytes, entry: FileEntry, where: str) -> None:
    got = FileEntry(size=len(data), crc32c=f"{google_crc32c.value(data):08x}")
    check_entry(got, entry, where)


def check_entry(got: FileEntry | None, want: FileEntry, where: str) -> None:
    """Raise `CorruptCheckpointError` naming `where` unless `got` (size and CRC32C of the bytes
    written) is what the part's record says."""
    if got is None or got != want:
        raise CorruptCheckpointError(
            f"'{where}' does not match its part record (got {got}, expected size "
            f"{want.size}, CRC32C {want.crc32c}): that copy is damaged and is not used"
        )
