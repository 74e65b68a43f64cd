"""Writing local-tier parts: a rank's own part (torch.save of its local shards, cut into pieces
that are flushed in parallel, timed phase by phase), and a replica received from its owner
(`PartWriter`, the same pieces, the way its disk takes replicas best, checked against the
owner's record). Every file and folder is fsynced before the part's record is written, and
the record before it counts (docs/design.md §9, docs/local-tier.md)."""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any, cast

import torch

from trainckpt.format.tensor_item import save_without_zip_crc
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
from trainckpt.storage.checksummed_file import ChecksummedWriter, buffer_address
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


class PartThreads:
    """The threads a rank's own parts are written with, kept from save to save (starting
    threads anew cost each save a few ms on a busy machine): a writer per piece (a piece's
    bytes are written in order, by one thread) and the flusher (writeback requests and the new
    folders' fsyncs: it waits on the disk and takes next to no CPU). Called on: each rank's
    local tier, which closes them with itself."""

    def __init__(self) -> None:
        self.writers = [
            ThreadPoolExecutor(1, thread_name_prefix="trainckpt-local-piece")
            for _ in range(max_pieces())
        ]
        self.flusher = ThreadPoolExecutor(
            max_pieces() + 2, thread_name_prefix="trainckpt-local-flush"
        )

    def close(self) -> None:
        for pool in (*self.writers, self.flusher):
            pool.shutdown(wait=True)


def write_own_part(
    root: Path,
    rank: int,
    step: int,
    attempt: str,
    state: dict[str, Any],
    trainer_bytes: bytes,
    world: int,
    clock: PhaseClock,
    threads: PartThreads,
) -> LocalPart:
    """Write this rank's own part of `step` under `root` (module state as local shards, cut
    into `piece_count` pieces of its tensor bytes; trainer state; then `part.json` with the
    size and CRC32C of every file), every file and folder fsynced, the time of each phase
    booked into `clock` (`crc` and `write` summed over the pieces' threads). Each piece is
    CRC'd, written, flushed and fsynced by a thread of its own while torch.save goes on with
    the next (one file written and fsynced at the end would wait for all of its bytes on one
    core); `part.json` is written only once every piece is durable, so a crash before leaves a
    part without a record, which never counts. Called on: each rank, for its own part."""
    folder = part_dir(root, step, attempt, rank)
    with writing(folder):
        folder.mkdir(parents=True)
    # the new folders' entries made durable while the part is written (they must be before
    # its record is); the part's own folder is fsynced with its record
    parents = threads.flusher.submit(_fsync_up_to, folder.parent, root)
    view = local_view(state)
    expected = sum(t.numel() * t.element_size() for t in _tensors(view))  # about the file's
    count = piece_count(expected)
    module = _Pieces(folder, MODULE_FILE, count, expected, clock, threads, _Staged(view))
    trainer = _Pieces(folder, TRAIN_FILE, 1, len(trainer_bytes), clock, threads)
    try:
        with clock("serialize"):  # the pieces' threads CRC and write meanwhile
            save_without_zip_crc(view, cast(IO[bytes], module))
            module.seal()
        fault_point("local-writing")  # module pieces handed to their threads
        trainer.write(trainer_bytes)
        trainer.seal()
        with clock("fsync"):  # what the pieces' threads still take once all is handed over
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


def _tensors(state: Any) -> Iterator[torch.Tensor]:
    """The tensors in `state` (nested dicts, lists and tuples)."""
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from _tensors(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from _tensors(v)


_WRITE_BUFFER = 1 << 20
"""Buffer of a piece file (torch.save's small writes, gathered by `_Pieces`; large ones pass)."""


_HAND_OVER_BYTES = 256 << 10
"""Bytes of the staged tensors from this size on are handed to a piece's thread in place;
smaller writes (and any write from a buffer torch reuses) are copied and gathered into one
hand-over of up to `_WRITE_BUFFER` bytes: a thread hand-over costs more than copying a few KB."""


class _Staged:
    """The address ranges of the staged tensors' storages: the bytes that stay where they are
    until the part is written (`write_own_part` holds the state until every piece is durable),
    so a piece's thread may read them after `torch.save` has moved on."""

    def __init__(self, state: Any) -> None:
        spans = sorted(
            (s.data_ptr(), s.data_ptr() + s.nbytes())
            for s in (t.untyped_storage() for t in _tensors(state))
            if s.device.type == "cpu" and s.nbytes() > 0
        )
        self._starts = [a for a, _b in spans]
        self._ends = [b for _a, b in spans]

    def holds(self, view: memoryview) -> bool:
        """Whether all of `view` lies inside one staged storage."""
        if not self._starts:
            return False
        address = buffer_address(view)
        i = bisect.bisect_right(self._starts, address) - 1
        return i >= 0 and address + len(view) <= self._ends[i]


class _Pieces:
    """A write-only file object (`write`, `tell`, `flush`: enough for `torch.save`) whose bytes
    go to `count` piece files of data file `name` in turn (the expected size split evenly,
    rounded up to `PIECE_ALIGN`; the last piece takes whatever is left), or to `name` itself when
    `count` is 1. Each piece is written by a thread of its own (`_Piece`), so the serializing
    thread only hands bytes over and the pieces' CRC32C and writes run in parallel, as
    `save()`'s files do on its writer threads. Bytes in `staged` storages are handed over in
    place; any other bytes are copied first (torch reuses its header buffers)."""

    def __init__(
        self,
        folder: Path,
        name: str,
        count: int,
        expected: int,
        clock: PhaseClock,
        threads: PartThreads,
        staged: _Staged | None = None,
    ) -> None:
        self._folder, self._name, self._count = folder, name, count
        self._target = -(-max(1, -(-expected // count)) // PIECE_ALIGN) * PIECE_ALIGN
        self._clock, self._threads, self._staged = clock, threads, staged
        self._size = 0
        self._pieces: list[_Piece] = []
        self._open: _Piece | None = None
        self._gathered = bytearray()  # small writes not handed over yet
        self._failure: Exception | None = None  # the first, raised by `seal`

    def _current(self) -> _Piece:
        if self._open is None:
            index = len(self._pieces)
            name = self._name if self._count == 1 else piece_name(self._name, index)
            threads = self._threads
            writer = threads.writers[index % len(threads.writers)]  # a piece's bytes in order
            self._open = _Piece(self._folder / name, name, self._clock, writer, threads.flusher)
            self._pieces.append(self._open)
        return self._open

    def write(self, data: Any) -> int:
        """Take `data` (from torch's writer, or `trainer_bytes`). Never raises: an exception
        thrown back into torch's C++ writer terminates the process (a full disk would kill the
        rank), so the first failure is kept, the rest skipped, and `seal` raises it."""
        view = memoryview(data).cast("B")
        if self._failure is not None:
            return len(view)
        try:
            if len(view) < _HAND_OVER_BYTES:
                self._gather(view)
            elif isinstance(data, bytes) or (self._staged is not None and self._staged.holds(view)):
                self._hand_over(view)
            else:
                self._gather(view)
        except Exception as e:
            self._failure = e
        return len(view)

    def _gather(self, view: memoryview) -> None:
        self._gathered += view
        if len(self._gathered) >= _WRITE_BUFFER:
            self._hand_over_gathered()

    def _hand_over_gathered(self) -> None:
        if self._gathered:
            gathered, self._gathered = self._gathered, bytearray()
            self._hand_over(memoryview(gathered))

    def _hand_over(self, view: memoryview) -> None:
        """Give `view` to the open piece (and those after it once a piece is full), in order."""
        self._hand_over_gathered()
        done = 0
        while done < len(view):
            piece = self._current()
            last = len(self._pieces) == self._count
            take = len(view) - done if last else min(len(view) - done, self._target - piece.size)
            piece.write(view[done : done + take])
            done += take
            self._size += take
            if not last and piece.size >= self._target:
                piece.seal()
                self._open = None

    def tell(self) -> int:
        return self._size + len(self._gathered)

    def flush(self) -> None:
        """Nothing: each piece is flushed when it is full, the last one by `seal`."""

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return False

    def seal(self) -> None:
        """The data file is complete: hand over what is gathered and seal the last piece (an
        empty file if nothing was written at all). Raises the first failure of `write`."""
        if self._failure is not None:
            raise self._failure
        self._hand_over_gathered()
        self._current().seal()
        self._open = None

    def entries(self) -> dict[str, FileEntry]:
        """Size and CRC32C of every piece, once all are durable (waits for their threads)."""
        return {piece.name: piece.entry() for piece in self._pieces}

    def abandon(self) -> None:
        """Wait for every piece's thread and close its file (after a failure: the part then
        never counts; after success: nothing is left to do)."""
        for piece in self._pieces:
            piece.abandon()


class _Piece:
    """One piece file, written in the order its bytes were handed over, by one `writer`
    thread: CRC32C and write (booked as `crc` and `write`), a writeback request to `flusher` per
    `WRITEBACK_BYTES`; once sealed, flushed, fsynced and closed there. The first failure stops
    its writes; `entry` raises it."""

    def __init__(
        self,
        path: Path,
        name: str,
        clock: PhaseClock,
        writer: ThreadPoolExecutor,
        flusher: ThreadPoolExecutor,
    ) -> None:
        self.path, self.name, self.size = path, name, 0
        with writing(path):
            self._f = open(path, "xb", buffering=_WRITE_BUFFER)  # noqa: SIM115  # closed by _finish
        self._writer = _TimedWriter(_TimedFile(self._f, clock), clock)
        self._thread, self._flusher = writer, flusher
        self._writeback_from = 0  # where the next writeback request starts
        self._writebacks: list[Future[None]] = []
        self._error: BaseException | None = None
        self._done: Future[None] | None = None

    def write(self, view: memoryview) -> None:
        """Hand `view` over (it must stay valid until the piece is durable)."""
        self.size += len(view)
        self._thread.submit(self._write, view)

    def seal(self) -> None:
        """No more bytes: flush, fsync and close once the writes are done."""
        self._done = self._thread.submit(self._finish)

    def entry(self) -> FileEntry:
        """Size and CRC32C, once durable; raises what failed."""
        assert self._done is not None, "sealed first"
        self._done.result()
        return self._writer.entry()

    def abandon(self) -> None:
        if self._done is None:
            self.seal()
        assert self._done is not None
        self._done.exception()

    def _write(self, view: memoryview) -> None:
        if self._error is not None:
            return
        try:
            with writing(self.path):
                self._writer.write(view)
            self._start_writeback()
        except BaseException as e:  # kept for `entry`; the piece's later writes are skipped
            self._error = e

    def _start_writeback(self) -> None:
        """Once `WRITEBACK_BYTES` more are in the kernel, ask it (on the flusher: the request
        may wait for the disk's queue) to start writing them out."""
        fd = self._f.fileno()
        written = os.lseek(fd, 0, os.SEEK_CUR)  # past the file object's own buffer
        if written - self._writeback_from >= WRITEBACK_BYTES:
            self._writebacks.append(
                self._flusher.submit(start_writeback, fd, self._writeback_from, written)
            )
            self._writeback_from = written

    def _finish(self) -> None:
        """fsync and close, once the writeback requests on the descriptor are done (none may
        reach a descriptor closed and reused meanwhile). After a failure the file is closed
        quietly: its buffer cannot be written either, and the first failure is the one that
        names what went wrong."""
        try:
            if self._error is not None:
                raise self._error
            with writing(self.path):
                self._writer.flush()
                for writeback in self._writebacks:
                    writeback.exception()
                os.fsync(self._f.fileno())
                self._f.close()
        except BaseException:
            for writeback in self._writebacks:
                writeback.exception()
            with contextlib.suppress(OSError):
                self._f.close()
            raise


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


def _fsync_up_to(folder: Path, root: Path) -> None:
    """fsync `folder` and each parent up to and including `root` (new folders are entries of
    their parents: without this a power cut may lose them)."""
    current = folder
    while True:
        fsync_dir(current)
        if current == root or current == current.parent:
            return
        current = current.parent
