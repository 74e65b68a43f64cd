"""Checking a local-tier part before it is loaded: a private copy of it (check what you copy),
each file's CRC32C computed from exactly the bytes written into the copy and compared with the
part's record, and the checked copy's states read back. Nothing read is ever unpickled but by
`load_torch_plain`."""

from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

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
from trainckpt.storage.checksummed_file import crc32c_extend
from trainckpt.storage.checksums import FileEntry, crc32c_combine
from trainckpt.storage.private_file import PrivateFile


class PrivateCopy:
    """A part's data files copied into private files (`storage/private_file.py`) in the attempt
    folder, one per data file (its pieces, if any, one after another), the CRC32C of each
    computed from exactly the bytes written into the copy and checked against the part's
    record when the copy is closed (a file in pieces against its pieces' CRC32Cs combined, so
    every byte is CRC'd once; a mismatch is then narrowed down to the piece, to name it).
    Loading from it loads what was checked, whatever happens to the part's own files meanwhile
    (check what you copy). A sink of `exchange` (a copy received from a holder), or filled
    from the own copy (`copy_own`)."""

    def __init__(self, folder: Path, part: LocalPart, source: str) -> None:
        self.part, self._split = part, Splitter(part)
        self.source = source  # the part copied, for messages
        owner = f"rank{part.owner}"
        self.files = {
            name: PrivateFile(folder, f"{owner}.{name}.restore.tmp") for name in PART_FILES
        }
        self._into = {f: name for name, f, _e in part.stream()}
        """The data file each file on disk (piece) is copied into."""
        self.checked = False

    def write(self, data: memoryview) -> None:
        for f, piece, _done in self._split.pieces(data):
            self.files[self._into[f]].write(piece)

    def close(self) -> None:
        """Check every data file against the record (`CorruptCheckpointError` naming the file,
        or the piece, that differs)."""
        if self.checked:
            return
        for name in PART_FILES:
            pieces = self.part.pieces(name)
            got = self.files[name].entry()
            if got != combined(pieces):
                self._name_damaged_piece(name, pieces)
            check_entry(got, combined(pieces), f"'{name}' of {self.source}, as copied")
        self.checked = True

    def _name_damaged_piece(self, name: str, pieces: list[tuple[str, FileEntry]]) -> None:
        """Raise for the first piece of `name` whose bytes in the copy differ from the record
        (read back from the copy: what was written there is what was checked)."""
        fd, offset = self.files[name].fd, 0
        for f, want in pieces:
            crc, size = 0, 0
            while size < want.size:
                data = os.pread(fd, min(_COPY_CHUNK, want.size - size), offset + size)
                if not data:
                    break
                crc, size = crc32c_extend(crc, memoryview(data)), size + len(data)
            got = FileEntry(size=size, crc32c=f"{crc:08x}")
            check_entry(got, want, f"'{f}' of {self.source}, as copied for the restore")
            offset += want.size

    def drop(self) -> None:
        """Free the files (a failed copy)."""
        for f in self.files.values():
            f.close()

    def __enter__(self) -> PrivateCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()


def combined(pieces: list[tuple[str, FileEntry]]) -> FileEntry:
    """Size and CRC32C of the pieces' bytes one after another, from their entries alone."""
    crc, size = int(pieces[0][1].crc32c, 16), pieces[0][1].size
    for _f, entry in pieces[1:]:
        crc = crc32c_combine(crc, int(entry.crc32c, 16), entry.size)
        size += entry.size
    return FileEntry(size=size, crc32c=f"{crc:08x}")


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
    _check(data, copy.part.pieces(TRAIN_FILE), copy.source)
    return state, deserialize_trainer_state(data, train_where, on_rank_device(CudaCalls()))


def _check(data: bytes, pieces: list[tuple[str, FileEntry]], source: str) -> None:
    """Check `data`, a whole data file of `source` as copied, piece by piece against the
    record's `pieces` (one piece: the file itself)."""
    view, start = memoryview(data), 0
    for f, entry in pieces:
        chunk = view[start : start + entry.size]
        got = FileEntry(size=len(chunk), crc32c=f"{crc32c_extend(0, chunk):08x}")
        check_entry(got, entry, f"'{f}' of {source}, as copied and checked")
        start += entry.size
    if start != len(data):
        where = f"'{pieces[0][0]}' ... of {source}, as copied and checked"
        check_entry(None, FileEntry(size=start, crc32c=pieces[-1][1].crc32c), where)


def check_entry(got: FileEntry | None, want: FileEntry, where: str) -> None:
    """Raise `CorruptCheckpointError` naming `where` unless `got` (size and CRC32C of the bytes
    written) is what the part's record says."""
    if got is None or got != want:
        raise CorruptCheckpointError(
            f"'{where}' does not match its part record (got {got}, expected size "
            f"{want.size}, CRC32C {want.crc32c}): that copy is damaged and is not used"
        )
