"""A separate process that writes the shard files of async saves (`async_writer="process"`).

A save writing on threads of the training process competes with training for the interpreter
lock: every step of the training loop then waits, again and again, for a writer thread to let
go of it (docs/performance.md has the measurement). This process takes that part away. The
staged state reaches it through shared memory (`shared_memory.Arena`: the descriptor of each
arena is sent once, the process maps it and keeps it while saves use it), so per save only a
short job crosses the socket: which bytes go into which file.

Everything else of the save stays on the checkpointer's save thread: DCP's planning (a
collective), the trainer state, the manifest and the commit protocol. The process writes the
files exactly as the threads would (`shard_writer.write_shard`) and reports each one (size,
CRC32C, where each item lies) as it is complete, so uploads start as early as before. A write
that fails there fails the save with the same `StorageError`. If the process dies, the save
fails with an error saying so (nothing of it is committed) and the next save starts a new
process. If the training process dies, the writer exits: its socket closes, and it checks every
second that its parent is alive.

The process is started with `python -m trainckpt.core.writer_process`, not by
`multiprocessing`'s spawn, which would import the training script again in the child.
"""

from __future__ import annotations

import errno
import gc
import io
import logging
import mmap
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from pathlib import Path

import torch

from trainckpt.core.shared_memory import Arena, Locator, Span, allocate, file_size_limit
from trainckpt.errors import CheckpointError, StorageError
from trainckpt.format.shard_writer import ItemData, Shard, WrittenShard, write_shard
from trainckpt.identity import identity
from trainckpt.storage.local import write_failure
from trainckpt.testing.faults import fault_point

log = logging.getLogger(__name__)


def default_threads() -> int:
    """Writer threads when `save_thread_count` is unset: the cores training leaves free (at
    least one, at most four)."""
    return max(1, min(4, (os.cpu_count() or 1) - torch.get_num_threads()))


View = tuple[str, tuple[int, ...], tuple[int, ...], int]
"""A staged tensor's view of its storage: dtype (as `str(dtype)`), shape, strides and storage
offset. Equal views are one object within a save's job (`_Refs`), so the job's pickle holds
each once."""

TensorRef = tuple[str | None, int, int, View]
"""A tensor in an arena: the arena's id, offset and size of its storage's bytes (None, 0, 0
for an empty tensor) and its view of them. A plain tuple: a job holds thousands, and tuples
pickle in C, where a dataclass pickles through Python per item."""


@dataclass(frozen=True)
class Job:
    """The shard files of one rank's save, for the writer process."""

    folder: str
    save_id: str
    fsync: bool
    threads: int
    shards: list[tuple[str, list[TensorRef | bytes]]]
    """Per shard file: its name and its items in order (a byte item as its bytes)."""
    arenas: dict[str, int]
    """Id -> size of every arena the job reads; the process unmaps any other."""
    new_arenas: list[str]
    """Arenas the process has not mapped yet: their descriptors follow the job, in order."""
    scratch: list[str]
    """Arenas of this save only: the process unmaps them once it is done."""
    digests: bool = False
    """Whether each file's small tensors are hashed (`WrittenShard.digests`)."""


class WriterProcess:
    """The training process's side: a `ShardWriter` whose files another process writes.

    Called on: every rank, from the checkpointer's save thread (one save at a time), and
    `close` from the training thread once no save is pending.
    """

    def __init__(self) -> None:
        self.threads = 1
        """Writer threads inside the process, for the next save."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._mapped: set[str] = set()  # arenas the process holds
        self._refs = _Refs()

    def write_shards(
        self,
        folder: Path,
        shards: list[Shard],
        save_id: str,
        fsync: bool,
        on_file: Callable[[str], None] | None,
        digests: bool = False,
    ) -> list[WrittenShard]:
        if not shards:
            return []
        arenas: dict[str, Arena] = {}  # also keeps scratch arenas alive until the end
        job_shards, scratch = _export(folder, shards, arenas, self._refs)
        conn, pid = self._connection()
        new = [a for a in arenas if a not in self._mapped]
        job = Job(
            str(folder),
            save_id,
            fsync,
            max(1, min(self.threads, len(shards))),
            job_shards,
            {a: arena.size for a, arena in arenas.items()},
            new,
            scratch,
            digests,
        )
        written: dict[str, WrittenShard] = {}
        try:
            conn.send(job)
            for a in new:
                send_handle(conn, arenas[a].fd, pid)
            self._mapped = set(arenas) - set(scratch)
            while True:
                kind, payload = conn.recv()
                if kind == "done":
                    break
                if kind == "error":
                    raise payload
                written[payload.name] = payload
                if on_file is not None:
                    on_file(payload.name)
        except CheckpointError:
            raise
        except (EOFError, OSError) as e:
            code = self._stop()
            raise StorageError(
                f"the writer process (pid {pid}) died ({_exit_text(code)}) while writing the "
                f"shard files under '{folder}'; nothing of this save was committed, and the "
                "next save starts a new writer process. If it keeps dying, look for its error "
                "above (or the kernel log: out of memory?), or set async_writer='thread'"
            ) from e
        except BaseException:
            self._stop()  # it may still be writing: a new save must not read its replies
            raise
        return [written[s.name] for s in shards]

    def start(self) -> None:
        """Start the process now (it imports torch for a few seconds), so that the first save
        does not wait for it. Called on: the training thread."""
        self._connection()

    def close(self) -> None:
        """Ask the process to exit (it finishes nothing: no save is pending); kill it after
        10 s. Called on: the training thread."""
        if self._conn is not None:
            try:
                self._conn.send(None)
            except OSError:
                pass
        self._stop(wait=10.0)

    def unmap_all(self) -> None:
        """Have the process unmap every arena it holds, now: the stager is dropping them (a
        shape change), so their memory is freed before new arenas are allocated, not when the
        next job arrives. Called on: the thread that stages, while no save is writing."""
        self._refs = _Refs()  # holds the stager's old tensors: let them go
        if not self._mapped or self._conn is None:
            return
        try:
            self._conn.send("unmap")
            self._conn.recv()  # "unmapped"
        except (EOFError, OSError) as e:
            log.warning("the writer process is gone (%s); the next save starts a new one", e)
            self._stop()
        self._mapped = set()

    def _connection(self) -> tuple[Connection, int]:
        """The socket to a live writer process, starting one if there is none."""
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            return self._conn, self._proc.pid
        self._stop()
        parent, child = socket.socketpair()
        with child:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
            )
        self._conn = Connection(parent.detach())
        self._mapped = set()
        log.info("started the writer process (pid %d)", self._proc.pid)
        return self._conn, self._proc.pid

    def _stop(self, wait: float = 0.0) -> int | None:
        """End the process (killed unless it exits within `wait` s); its exit code."""
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        self._mapped = set()
        self._refs = _Refs()
        if conn is not None:
            conn.close()
        if proc is None:
            return None
        try:
            return proc.wait(timeout=wait) if wait else _kill(proc)
        except subprocess.TimeoutExpired:
            return _kill(proc)


def _kill(proc: subprocess.Popen[bytes]) -> int:
    if proc.poll() is None:
        proc.kill()
    return proc.wait()


def _exit_text(code: int | None) -> str:
    if code is None:
        return "exit status unknown"
    return f"killed by signal {-code}" if code < 0 else f"exit code {code}"


class _Refs:
    """The references of the tensors of the last save, by tensor object: a background save
    hands the writer the stager's buffers, the same tensor objects save after save, so their
    references are looked up, not made again. An entry holds its tensor (whose id is the key,
    so the id cannot be reused while it is here) and its arena (alive while referenced); only
    the entries a save used are kept for the next one. A staged buffer is never re-viewed in
    place (no `set_`, `resize_`, `as_strided_`): the same object has the same storage and view.
    Called on: the save thread."""

    def __init__(self) -> None:
        self.last: dict[int, tuple[torch.Tensor, Arena, TensorRef]] = {}
        self.views: dict[View, View] = {}  # one object per distinct view (of the last save)


def _export(
    folder: Path, shards: list[Shard], arenas: dict[str, Arena], known: _Refs | None = None
) -> tuple[list[tuple[str, list]], list[str]]:
    """The job's view of `shards`: each tensor as a reference into the arena that holds it
    (filled into `arenas`), and the ids of the scratch arenas made for this save: a tensor
    outside every shared arena (a view `_resolve` cloned) is first copied into one. A tensor
    larger than the file-size limit fails the save as the threads' write of its file would (no
    shared arena can hold it). One pass over the items, on the save's thread: with thousands
    of entries, each lookup done twice was training's time too (the interpreter lock). With
    `known` (the references of the last save, updated to this save's), a tensor of the last
    save costs one lookup."""
    refs_of = _Refs() if known is None else known
    last, seen = refs_of.last, {}
    views: dict[View, View] = {}
    locator: Locator | None = None
    job: list[tuple[str, list]] = []
    outside: dict[int, tuple[str, torch.Tensor, list[tuple[list, int]]]] = {}
    for shard in shards:
        refs: list[TensorRef | bytes | None] = []
        append = refs.append
        for data in shard.data():
            if not isinstance(data, torch.Tensor):
                append(data.getvalue() if isinstance(data, io.BytesIO) else bytes(data))
                continue
            key = identity(data)
            hit = last.get(key)
            if hit is not None and hit[0] is data:
                seen[key] = hit
                arenas[hit[1].id] = hit[1]
                view = hit[2][3]
                views.setdefault(view, view)
                append(hit[2])
                continue
            if not data.numel():
                append(_reference(data, None, views))
                continue
            if locator is None:
                locator = Locator()
            found = locator.find(data)
            if found is None:
                outside.setdefault(key, (shard.name, data, []))[2].append((refs, len(refs)))
                append(None)  # filled in once copied into a scratch arena
                continue
            arena = found[0]
            arenas[arena.id] = arena
            ref = _reference(data, found[1], views)
            seen[key] = (data, arena, ref)
            append(ref)
        job.append((shard.name, refs))
    refs_of.last, refs_of.views = seen, views
    return job, _copy_outside(folder, outside, arenas, views)


def _copy_outside(
    folder: Path,
    outside: dict[int, tuple[str, torch.Tensor, list[tuple[list, int]]]],
    arenas: dict[str, Arena],
    views: dict[View, View],
) -> list[str]:
    """Copy the tensors `_export` found outside every arena into new scratch arenas and put
    their references in the places left for them; return the scratch arenas' ids."""
    if not outside:
        return []
    limit = file_size_limit()
    for name, t, _ in outside.values():
        if limit is not None and t.untyped_storage().nbytes() > limit:
            raise write_failure(folder / name, OSError(errno.EFBIG, os.strerror(errno.EFBIG)))
    tensors = [t for _, t, _ in outside.values()]
    places = allocate([t.untyped_storage().nbytes() for t in tensors], shared=True)
    locator = Locator()
    for (_, t, where), (arena, offset) in zip(outside.values(), places, strict=True):
        copy = arena.copy_of(offset, t)
        found = locator.find(copy)
        assert found is not None  # just copied into a shared arena
        arenas[arena.id] = arena
        ref = _reference(copy, found[1], views)
        for refs, i in where:
            refs[i] = ref
    return sorted({arena.id for arena, _ in places})


def _reference(data: torch.Tensor, span: Span | None, views: dict[View, View]) -> TensorRef:
    """`data` as the writer process finds it: where its storage is (`span`; None for an empty
    tensor) and its view of it (equal views as one object, from `views`)."""
    view: View = (
        str(data.dtype),
        tuple(data.shape),
        tuple(data.stride()),
        int(data.storage_offset()),
    )
    view = views.setdefault(view, view)
    if span is None:
        return (None, 0, 0, view)
    return (span.arena_id, span.offset, span.size, view)


# -- the writer process --------------------------------------------------------------------------


def _serve(conn: Connection) -> None:
    """Write the jobs that arrive until the socket closes or a None arrives."""
    maps: dict[str, mmap.mmap] = {}
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        if job is None:
            return
        if job == "unmap":
            maps.clear()  # unmapped: no tensor of a finished job is left
            conn.send("unmapped")
            continue
        for a in job.new_arenas:
            fd = recv_handle(conn)
            try:
                maps[a] = mmap.mmap(fd, job.arenas[a])
            finally:
                os.close(fd)
        for a in set(maps) - set(job.arenas):
            del maps[a]  # unmapped once the last save's tensors are gone
        gc.disable()  # a job makes objects by the ten thousand, and no cycles to collect
        try:
            outcome = _write_job(conn, job, maps)
        finally:
            gc.enable()
        for a in job.scratch:
            del maps[a]  # unmapped before the outcome is sent: the save is over then
        conn.send(outcome)


def _write_job(
    conn: Connection, job: Job, maps: dict[str, mmap.mmap]
) -> tuple[str, CheckpointError | None]:
    """Write every shard of `job` on `job.threads` threads; send each as it is complete.
    Returns the outcome to send once the job's memory is let go: "done", or the first failure
    once every file is finished or failed."""
    folder = Path(job.folder)

    def write(name: str, refs: list[TensorRef | bytes]) -> WrittenShard:
        return write_shard(folder, name, _items(refs, maps), job.save_id, job.fsync, job.digests)

    error: BaseException | None = None
    with ThreadPoolExecutor(job.threads, thread_name_prefix="trainckpt-write") as pool:
        futures = [pool.submit(write, name, refs) for name, refs in job.shards]
        for future in as_completed(futures):
            try:
                conn.send(("file", future.result()))
            except BaseException as e:
                error = error or e
    outcome = ("done", None) if error is None else ("error", _portable(error, folder))
    error = None  # its traceback holds this frame, and so the last tensors: unmap them now
    return outcome


def _items(refs: list[TensorRef | bytes], maps: dict[str, mmap.mmap]) -> Iterator[ItemData]:
    for i, ref in enumerate(refs):
        yield ref if isinstance(ref, bytes) else _tensor(ref, maps)
        if i == 0:
            fault_point("writer-process-writing")


_DTYPES: dict[str, tuple[torch.dtype, int]] = {}
"""dtype name -> (dtype, element size): looked up once per dtype, not per item."""


def _dtype(name: str) -> tuple[torch.dtype, int]:
    known = _DTYPES.get(name)
    if known is None:
        dtype = getattr(torch, name.removeprefix("torch."))
        known = _DTYPES[name] = (dtype, torch.empty((), dtype=dtype).element_size())
    return known


def _tensor(ref: TensorRef, maps: dict[str, mmap.mmap]) -> torch.Tensor:
    """The staged tensor `ref` names, on the shared memory (no copy), with a storage of exactly
    its bytes as it had when staged."""
    arena_id, offset, size, (dtype_name, shape, stride, storage_offset) = ref
    dtype, itemsize = _dtype(dtype_name)
    if arena_id is None:
        return torch.empty_strided(shape, stride, dtype=dtype)
    flat = torch.frombuffer(maps[arena_id], dtype=dtype, count=size // itemsize, offset=offset)
    return flat.as_strided(shape, stride, storage_offset)


def _portable(error: BaseException, folder: Path) -> CheckpointError:
    """`error` as the training process should see it (our errors as they are)."""
    if isinstance(error, CheckpointError):
        try:
            pickle.loads(pickle.dumps(error))
            return error
        except Exception:
            pass
    return StorageError(
        f"writing the shard files under '{folder}' failed in the writer process "
        f"({type(error).__name__}: {error}); nothing of this save was committed: fix the cause "
        "and save again"
    )


def _exit_with_parent(parent: int) -> None:
    """Exit as soon as the training process is gone (it was killed: finishing its files would
    only race the cleanup of its successor)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def main(argv: list[str]) -> int:
    conn = Connection(int(argv[0]))
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    torch.set_num_threads(1)
    gc.freeze()  # what the imports made is never garbage: collections skip it
    _serve(conn)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
