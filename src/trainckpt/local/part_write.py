"""Writing local-tier parts: a rank's own part (torch.save of its local shards, cut into pieces
that are flushed in parallel, timed phase by phase), and a replica received from its owner
(`PartWriter`, the same pieces, the way its disk takes replicas best, checked against the
owner's record). Every file and folder is fsynced before the part's record is written, and
the record before it counts (docs/design.md §9, docs/local-tier.md)."""

from __future__ import annotations

import ctypes
import os
import pickle
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any, cast

import torch

from trainckpt.local.layout import (
    MODULE_FILE,
    PART_FILE,
    TRAIN_FILE,
    LocalPart,
    part_dir,
    piece_name,
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

PIECE_BYTES = 64 << 20
"""A data file of a part is cut into a piece per this many bytes (at most `max_pieces()`)."""


WRITEBACK_BYTES = 16 << 20
"""While a piece is written, the kernel is asked to start writing each further this many bytes
of it to the disk (`start_writeback`), on a flusher thread: the disk works from the first
chunk on, instead of only once a piece is full, and the piece's fsync has little left to wait
for."""


PIECE_ALIGN = 4096
"""Piece sizes (but the last's) are multiples of this: each piece starts page-aligned in the
transfer's page-aligned chunk buffers, so a replica written with `O_DIRECT` writes every piece
from the buffer in place (`storage/direct_file.py`) instead of copying it."""


def max_pieces() -> int:
    """Most pieces a part's module file is cut into: as many as `save()` has writer threads by
    default (`saving.default_threads`: min(4, CPUs)), whose files flush in parallel too."""
    return max(1, min(4, os.cpu_count() or 1))


def piece_count(nbytes: int) -> int:
    """Pieces for a data file of about `nbytes`: one per `PIECE_BYTES`, 1 to `max_pieces()`."""
    return max(1, min(max_pieces(), -(-nbytes // PIECE_BYTES)))


def write_own_part(
    root: Path,
    rank: int,
    step: int,
    attempt: str,
    state: dict[str, Any],
    trainer_bytes: bytes,
    world: int,
    clock: PhaseClock,
    flusher: ThreadPoolExecutor,
) -> LocalPart:
    """Write this rank's own part of `step` under `root` (module state as local shards, cut
    into `piece_count` pieces of its tensor bytes; trainer state; then `part.json` with the
    size and CRC32C of every file), every file and folder fsynced, the time of each phase
    booked into `clock`. Each piece is flushed and fsynced on a thread of its own as soon as
    it is full, while the next one is written (one file fsynced at the end waited for all of
    its bytes at once); `part.json` is written only once every piece is durable, so a crash
    before leaves a part without a record, which never counts. `flusher` runs the fsyncs
    (at least `max_pieces() + 2` threads: every piece, the trainer state and the new folders'
    parents at once). Called on: each rank, for its own part."""
    folder = part_dir(root, step, attempt, rank)
    with writing(folder):
        folder.mkdir(parents=True)
    # the new folders' entries made durable while the part is written (they must be before
    # its record is); the part's own folder is fsynced with its record
    parents = flusher.submit(_fsync_up_to, folder.parent, root)
    view = local_view(state)
    expected = _tensor_bytes(view)
    count = piece_count(expected)
    module = _Pieces(folder, MODULE_FILE, count, expected, clock, flusher)
    trainer = _Pieces(folder, TRAIN_FILE, 1, len(trainer_bytes), clock, flusher)
    try:
        start, cpu = time.perf_counter(), time.thread_time()
        _torch_save_without_zip_crc(view, module)
        module.seal()
        clock.add(
            "serialize",
            time.perf_counter() - start - module.booked,
            time.thread_time() - cpu - module.booked_cpu,
        )
        fault_point("local-writing")  # module pieces handed to their flushes
        trainer.write(trainer_bytes)
        trainer.seal()
        with clock("fsync"):  # what the flushes still take once all is written
            files = {**module.entries(), **trainer.entries()}
    finally:
        module.abandon()
        trainer.abandon()
        parents.exception()  # waited for on every path: nothing runs on after a failure
    part = LocalPart(step=step, attempt=attempt, owner=rank, world_size=world, files=files)
    with clock("fsync"):
        with writing(folder.parent):
            parents.result()
        write_local_record(folder / PART_FILE, part)  # fsyncs `folder` too
    return part


def _tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in `state` (nested dicts and lists): about a module file's size."""
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0


_WRITE_BUFFER = 1 << 20
"""Buffer of the own part's files (torch.save's small header writes; large ones pass)."""


class _Pieces:
    """A write-only file object (`write`, `tell`, `flush`: enough for `torch.save`) whose bytes
    go to `count` piece files of data file `name` in turn (the expected size split evenly,
    rounded up to `PIECE_ALIGN`; the last piece takes whatever is left), or to `name` itself when
    `count` is 1. The open piece's writeback is started every `WRITEBACK_BYTES` on `flusher`,
    and a full piece is flushed and fsynced there while the next is written. Its time is
    booked into `clock` (`crc`, `write`; `booked` is their sum)."""

    def __init__(
        self,
        folder: Path,
        name: str,
        count: int,
        expected: int,
        clock: PhaseClock,
        flusher: ThreadPoolExecutor,
    ) -> None:
        self._folder, self._name, self._count = folder, name, count
        self._target = -(-max(1, -(-expected // count)) // PIECE_ALIGN) * PIECE_ALIGN
        self._clock, self._flusher = clock, flusher
        self._size = 0
        self._open: tuple[str, Path, Any, _TimedWriter] | None = None
        self._flushing: list[tuple[str, _TimedWriter, Future[None]]] = []
        self._writeback_from = 0  # of the open piece: where its next writeback request starts
        self._writebacks: list[Future[None]] = []  # of the open piece, in the order asked
        self.booked = 0.0
        self.booked_cpu = 0.0

    def _file_name(self, index: int) -> str:
        return self._name if self._count == 1 else piece_name(self._name, index)

    def _current(self) -> _TimedWriter:
        if self._open is None:
            name = self._file_name(len(self._flushing))
            path = self._folder / name
            with writing(path):
                f = open(path, "xb", buffering=_WRITE_BUFFER)  # noqa: SIM115  # closed by _durable or abandon
            self._open = (name, path, f, _TimedWriter(_TimedFile(f, self._clock), self._clock))
        return self._open[3]

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            w = self._current()
            last = len(self._flushing) == self._count - 1
            take = len(view) - done
            if not last:
                take = min(take, self._target - w.tell())
            start, cpu = time.perf_counter(), time.thread_time()
            assert self._open is not None
            with writing(self._open[1]):
                w.write(view[done : done + take])
            self.booked += time.perf_counter() - start
            self.booked_cpu += time.thread_time() - cpu
            done += take
            self._size += take
            if not last and w.tell() >= self._target:
                self._hand_over()
            else:
                self._start_writeback()
        return len(view)

    def tell(self) -> int:
        return self._size

    def flush(self) -> None:
        """Nothing: each piece is flushed when it is full, the last one by `seal`."""

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def seal(self) -> None:
        """The data file is complete: hand over its last piece (an empty file if nothing was
        written at all)."""
        self._current()
        self._hand_over()

    def _start_writeback(self) -> None:
        """Once `WRITEBACK_BYTES` more of the open piece are in the kernel, ask it (on the
        flusher: the request may wait for the disk's queue) to start writing them out."""
        assert self._open is not None
        fd = self._open[2].fileno()
        written = os.lseek(fd, 0, os.SEEK_CUR)  # past the file object's own buffer
        if written - self._writeback_from >= WRITEBACK_BYTES:
            self._writebacks.append(
                self._flusher.submit(start_writeback, fd, self._writeback_from, written)
            )
            self._writeback_from = written

    def _hand_over(self) -> None:
        """Flush the open piece's buffer here, its fsync and close on the flusher."""
        assert self._open is not None
        name, path, f, w = self._open
        start, cpu = time.perf_counter(), time.thread_time()
        with writing(path):
            w.flush()  # if this fails, the piece stays open and `abandon` closes it
        self.booked += time.perf_counter() - start
        self.booked_cpu += time.thread_time() - cpu
        self._open = None
        writebacks, self._writebacks, self._writeback_from = self._writebacks, [], 0
        self._flushing.append((name, w, self._flusher.submit(_durable, path, f, writebacks)))

    def entries(self) -> dict[str, FileEntry]:
        """Size and CRC32C of every piece, once all are durable (waits for the flushes)."""
        out = {}
        for name, w, done in self._flushing:
            done.result()
            out[name] = w.entry()
        return out

    def abandon(self) -> None:
        """Close what is still open (after a failure; the part then never counts)."""
        if self._open is not None:
            for writeback in self._writebacks:
                writeback.exception()  # wait: its file descriptor stays open until then
            self._writebacks = []
            self._open[2].close()
            self._open = None
        for _name, _w, done in self._flushing:
            done.exception()  # wait: no file is closed under its flush


def _durable(path: Path, f: Any, writebacks: list[Future[None]]) -> None:
    """fsync and close a flushed file (on a flusher thread), once the writeback requests on
    its descriptor are done (no request may reach a descriptor closed and reused meanwhile).
    They were submitted before this job, so they have all been started by the time it runs:
    waiting for them here never waits for the pool."""
    try:
        for writeback in writebacks:
            writeback.exception()
        with writing(path):
            os.fsync(f.fileno())
    finally:
        f.close()


_SYNC_FILE_RANGE_WRITE = 2
"""`SYNC_FILE_RANGE_WRITE` (linux/fs.h): start writeback of the range's dirty pages, wait for
nothing. Never with the WAIT flags: waiting consumes the file's writeback error (errseq) that
the final fsync must report."""


def _libc_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux: the fsync alone does the work
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _libc_sync_file_range()


def start_writeback(fd: int, start: int, end: int) -> None:
    """Ask the kernel to start writing bytes [start, end) of `fd` to the disk, and return
    without waiting (ctypes releases the interpreter lock for the call). Only a head start:
    a failure here is ignored, the fsync that follows reports every write error."""
    if _sync_file_range is not None:
        _sync_file_range(fd, start, end - start, _SYNC_FILE_RANGE_WRITE)


class _TimedWriter(ChecksummedWriter):
    """A `ChecksummedWriter` that books its time: `crc` (its own work) and `write` (the
    file's, through `_TimedFile`)."""

    def __init__(self, f: _TimedFile, clock: PhaseClock) -> None:
        super().__init__(f)
        self._clock = clock
        self._timed_file = f

    def write(self, data: Any) -> int:
        f = self._timed_file
        start, cpu, written, written_cpu = time.perf_counter(), time.thread_time(), f.seconds, f.cpu
        n = super().write(data)
        self._clock.add(
            "crc",
            time.perf_counter() - start - (f.seconds - written),
            time.thread_time() - cpu - (f.cpu - written_cpu),
        )
        return n


class _TimedFile:
    """A file whose writes are timed (`seconds`, `cpu`, and the clock's `write`)."""

    def __init__(self, f: Any, clock: PhaseClock) -> None:
        self._f, self._clock, self.seconds, self.cpu = f, clock, 0.0, 0.0

    def write(self, data: Any) -> int:
        start, cpu = time.perf_counter(), time.thread_time()
        n: int = self._f.write(data)
        spent, used = time.perf_counter() - start, time.thread_time() - cpu
        self.seconds += spent
        self.cpu += used
        self._clock.add("write", spent, used)
        return n

    def flush(self) -> None:
        with self._clock("write"):
            self._f.flush()


class PartWriter:
    """A replica received from a holder: its files (pieces) written the way its disk takes
    replicas best (`replica_file`: past the page cache or through it, `direct`), each fsynced
    on a flusher thread as soon as its last byte is in while the next one is written, each
    CRC32C checked against the owner's record at the end, then the record written last and
    the folders fsynced."""

    def __init__(self, root: Path, folder: Path, part: LocalPart, direct: bool) -> None:
        self._root, self._folder, self._split = root, folder, Splitter(part)
        self._direct = direct
        with writing(folder):
            folder.mkdir(parents=True)
        self._stack = ExitStack()
        self._writer: ReplicaWriter | None = None
        self._flusher = ThreadPoolExecutor(
            min(len(part.files), max_pieces() + 1), thread_name_prefix="trainckpt-local-flush"
        )
        self._flushing: list[tuple[str, ReplicaWriter, Future[None]]] = []

    def write(self, data: memoryview) -> None:
        for name, piece, done in self._split.pieces(data):
            writer = self._writer
            if writer is None:
                path = self._folder / name
                writer = self._writer = self._stack.enter_context(replica_file(path, self._direct))
            writer.write(piece)
            if done:  # the tail written and fsynced on the flusher
                closing = self._stack.pop_all()
                self._flushing.append((name, writer, self._flusher.submit(closing.close)))
                self._writer = None

    def close(self) -> None:
        try:
            if not self._split.finished:
                self.write(memoryview(b""))  # creates the empty files left, if that is all
        finally:
            self._stack.close()
            self._flusher.shutdown(wait=True)
        entries = {}
        for name, writer, done in self._flushing:
            done.result()
            entries[name] = writer.entry()
        part = self._split.part
        for name, want in part.files.items():
            check_entry(entries.get(name), want, str(self._folder / name))
        write_local_record(self._folder / PART_FILE, part)
        _fsync_up_to(self._folder, self._root)


def _torch_save_without_zip_crc(obj: Any, f: Any) -> None:
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
