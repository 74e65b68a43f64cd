"""Writing local-tier parts: a rank's own part (torch.save of its local shards, timed phase by
phase), and a replica received from its owner (`PartWriter`, the way its disk takes replicas
best, checked against the owner's record). Every file and folder is fsynced before it counts."""

from __future__ import annotations

import os
import pickle
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, cast

import torch

from trainckpt.local.layout import (
    MODULE_FILE,
    PART_FILE,
    PART_FILES,
    TRAIN_FILE,
    LocalPart,
    part_dir,
    write_local_record,
)
from trainckpt.local.module_state import local_view
from trainckpt.local.part_check import check_entry
from trainckpt.local.part_read import Splitter
from trainckpt.local.replica_file import ReplicaWriter, replica_file
from trainckpt.local.transfer import PhaseClock
from trainckpt.storage.checksummed_file import ChecksummedWriter
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.local import fsync_dir, writing
from trainckpt.testing.faults import fault_point


def write_own_part(
    root: Path,
    rank: int,
    step: int,
    attempt: str,
    state: dict[str, Any],
    trainer_bytes: bytes,
    world: int,
    clock: PhaseClock,
) -> LocalPart:
    """Write this rank's own part of `step` under `root` (module state as local shards, trainer
    state, then `part.json` with sizes and CRC32C), every file and folder fsynced, the time
    of each phase booked into `clock`. Called on: each rank, for its own part."""
    folder = part_dir(root, step, attempt, rank)
    with writing(folder):
        folder.mkdir(parents=True)
    files: dict[str, FileEntry] = {}
    with _timed_file(folder / MODULE_FILE, clock) as w:
        _torch_save_without_zip_crc(local_view(state), w)
    files[MODULE_FILE] = w.entry()
    fault_point("local-writing")
    with _timed_file(folder / TRAIN_FILE, clock) as w:
        w.write(trainer_bytes)
    files[TRAIN_FILE] = w.entry()
    part = LocalPart(step=step, attempt=attempt, owner=rank, world_size=world, files=files)
    with clock("fsync"):
        write_local_record(folder / PART_FILE, part)
        _fsync_up_to(folder, root)
    return part


_WRITE_BUFFER = 1 << 20
"""Buffer of the own part's files (torch.save's small header writes; large ones pass)."""


class _TimedWriter(ChecksummedWriter):
    """A `ChecksummedWriter` that books its time: `crc` (its own work) and `write` (the
    file's, through `_TimedFile`); `serialize` is what the caller spends between writes."""

    def __init__(self, f: _TimedFile, clock: PhaseClock) -> None:
        super().__init__(f)
        self._clock = clock
        self._timed_file = f
        self.crc_seconds = 0.0

    def write(self, data: Any) -> int:
        start, written = time.perf_counter(), self._timed_file.seconds
        n = super().write(data)
        crc = time.perf_counter() - start - (self._timed_file.seconds - written)
        self.crc_seconds += crc
        self._clock.add("crc", crc)
        return n


class _TimedFile:
    """A file whose writes are timed (`seconds`, and the clock's `write`)."""

    def __init__(self, f: Any, clock: PhaseClock) -> None:
        self._f, self._clock, self.seconds = f, clock, 0.0

    def write(self, data: Any) -> int:
        start = time.perf_counter()
        n: int = self._f.write(data)
        spent = time.perf_counter() - start
        self.seconds += spent
        self._clock.add("write", spent)
        return n

    def flush(self) -> None:
        with self._clock("write"):
            self._f.flush()


@contextmanager
def _timed_file(path: Path, clock: PhaseClock) -> Iterator[ChecksummedWriter]:
    """`checksummed_file` with its time booked into `clock` (`serialize`, `crc`, `write`,
    `fsync`)."""
    start = time.perf_counter()
    with writing(path), open(path, "xb", buffering=_WRITE_BUFFER) as f:
        timed = _TimedFile(f, clock)
        w = _TimedWriter(timed, clock)
        yield w
        timed.flush()
        booked = time.perf_counter() - start
        with clock("fsync"):
            os.fsync(f.fileno())
    clock.add("serialize", booked - timed.seconds - w.crc_seconds)


class PartWriter:
    """A replica received from a holder: its files written the way its disk takes replicas
    best (`replica_file`: past the page cache or through it, `direct`) and fsynced, each
    file's CRC32C computed from the bytes as they arrive and checked against the owner's record
    at the end, then the record written last and the folders fsynced."""

    def __init__(self, root: Path, folder: Path, part: LocalPart, direct: bool) -> None:
        self._root, self._folder, self._split = root, folder, Splitter(part)
        self._direct = direct
        with writing(folder):
            folder.mkdir(parents=True)
        self._stack = ExitStack()
        self._writer: ReplicaWriter | None = None
        self._entries: dict[str, FileEntry] = {}

    def write(self, data: memoryview) -> None:
        for name, piece, done in self._split.pieces(data):
            writer = self._writer
            if writer is None:
                path = self._folder / name
                writer = self._writer = self._stack.enter_context(replica_file(path, self._direct))
            writer.write(piece)
            if done:
                self._stack.close()  # the tail written and fsynced
                self._entries[name] = writer.entry()
                self._writer = None

    def close(self) -> None:
        if not self._split.finished:
            self.write(memoryview(b""))  # creates the empty files left, if that is all
        self._stack.close()
        part = self._split.part
        for name in PART_FILES:
            check_entry(self._entries.get(name), part.files[name], str(self._folder / name))
        write_local_record(self._folder / PART_FILE, part)
        _fsync_up_to(self._folder, self._root)


def _torch_save_without_zip_crc(obj: Any, f: ChecksummedWriter) -> None:
    """`torch.save(obj, f)` without the CRC32 torch's zip writer computes of every record (a
    second pass over every byte, about a third of the write's time). `torch.load` does not
    need it, and the part's CRC32C covers every byte of the file. This goes through torch's
    private `_save` (what `torch.save` runs with `set_crc32_options(False)`, which is
    process-wide and would race with the training thread's own `torch.save` calls); a torch
    without it gets a plain `torch.save`."""
    serialization: Any = torch.serialization
    try:
        writer = torch._C.PyTorchFileWriter(
            cast(Any, f), False, serialization._get_storage_alignment()
        )
        save = serialization._save
    except (AttributeError, TypeError):
        torch.save(obj, f)  # type: ignore[arg-type]  # a write-only file
        return
    save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def _fsync_up_to(folder: Path, root: Path) -> None:
    """fsync `folder` and each parent up to and including `root` (new folders are entries of
    their parents: without this a power cut may lose them)."""
    current = folder
    while True:
        fsync_dir(current)
        if current == root or current == current.parent:
            return
        current = current.parent
