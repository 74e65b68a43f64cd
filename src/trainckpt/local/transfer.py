"""Point-to-point copies of local-tier parts between ranks, pipelined, in bounded chunks.

Every rank of the group calls `exchange` with the same list of transfers (each: a source rank,
a destination rank and a byte count known to both). Each transfer moves in chunks of at most
`chunk` bytes through `depth` reusable buffers on each side (gloo `isend`/`irecv` of uint8
tensors that are views of those buffers, nothing copied in between). Chunk `c` of a transfer
travels in buffer `c % depth`; while it is in flight the source reads chunk `c + 1` into the
next buffer and the destination writes (and CRCs) chunk `c - 1` from the previous one. The
destination's writes run on a writer thread of their own (one per `exchange`, chunks in
order), so a rank that sends and receives at once reads its own part, sends, receives and
writes the peer's part at the same time instead of taking turns; a buffer is received into
again only once the writer is done with it. Memory per rank is `depth` chunks per transfer it
takes part in (2 x 16 MiB by default), whatever the part's size.

No pair of ranks can wait on each other: every rank first posts chunks `0 .. depth - 1` of all
its transfers, sends and receives, and then, for `c = 0, 1, ...`, waits for chunk `c` of its
transfers and posts chunk `c + depth` into the buffer that freed. Chunk `c` of every transfer
is thus posted on both sides before either waits for it, whatever the other transfers do.

A source that cannot read its bytes sends zeros of the same length (the receiver's CRC32C check
then fails), and a sink that fails keeps receiving into its buffers, so every chunk is still
matched on both sides; each side reports its own failures.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as tdist

from trainckpt.core import dist
from trainckpt.testing.faults import fault_point

log = logging.getLogger(__name__)

CHUNK = 16 << 20
"""Bytes per message."""

DEPTH = 2
"""Chunks in flight per transfer on each side (buffers of `CHUNK` bytes each)."""


@dataclass
class PhaseClock:
    """Seconds spent per named phase of one save on one rank (summed over calls): what the
    save's log line and `scripts/bench_local.py` report."""

    seconds: dict[str, float] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    """CPU seconds of the thread that ran each phase (`time.thread_time`): what a phase costs,
    which other jobs on the machine inflate less than its wall time."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, seconds: float, cpu: float = 0.0) -> None:
        """Book `seconds` (and `cpu` seconds of CPU) to `name` (from any thread: replicas are
        written on their own)."""
        with self._lock:
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
            self.cpu[name] = self.cpu.get(name, 0.0) + cpu

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the block as phase `name` (wall and this thread's CPU)."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start, time.thread_time() - cpu)


@dataclass(frozen=True)
class Transfer:
    """`size` bytes from rank `src` to rank `dst` (ranks of the group); `owner` names the part."""

    src: int
    dst: int
    owner: int
    size: int


class Source(Protocol):
    def readinto(self, buf: memoryview) -> int:
        """Fill `buf` (fewer bytes only at the end of the stream); return the count."""
        ...

    def close(self) -> None: ...


class Sink(Protocol):
    def write(self, data: memoryview) -> None: ...

    def close(self) -> None: ...


def exchange(
    transfers: Sequence[Transfer],
    group: dist.ProcessGroup | None,
    open_source: Callable[[Transfer], Source],
    open_sink: Callable[[Transfer], Sink],
    *,
    chunk: int = CHUNK,
    depth: int = DEPTH,
    clock: PhaseClock | None = None,
) -> dict[int, BaseException]:
    """Run `transfers`; return this rank's failures by transfer index (an empty dict: every
    transfer this rank sent or received went through its source and sink without error —
    the receiver still checks the CRC32C). A dead peer raises `RankFailedError`. `clock`
    gets this rank's time reading sources (`send read`), waiting for sends to leave
    (`send wait`), waiting for chunks to arrive (`receive wait`), in sinks (`receive write`,
    on the writer thread, overlapping the others), waiting for the writer to free a buffer
    (`write wait`: the disk is behind the network), and closing sinks (`receive close`: a
    replica's tail, fsync and record).

    Called on: all ranks of `group`, with the same `transfers`."""
    if chunk < 1 or depth < 1:
        raise ValueError(f"chunk ({chunk}) and depth ({depth}) must be positive")
    start = time.perf_counter()
    rank = dist.get_rank(group)
    errors: dict[int, BaseException] = {}
    ends: list[_End] = []
    writer = None
    if any(t.dst == rank for t in transfers):
        writer = ThreadPoolExecutor(1, thread_name_prefix="trainckpt-local-writer")
    for i, t in enumerate(transfers):
        if t.src == rank:
            source = _open(open_source, t, i, errors)
            ends.append(_Outgoing(i, t, source, group, chunk, depth, clock))
        if t.dst == rank:
            sink = _open(open_sink, t, i, errors)
            assert writer is not None
            ends.append(_Incoming(i, t, sink, group, chunk, depth, clock, writer))
    # receives first: they cost nothing to post, and the senders' first chunks can land at once
    ends.sort(key=lambda e: isinstance(e, _Outgoing))
    chunks = max((e.chunks for e in ends), default=0)
    try:
        with dist.peers("copying local checkpoint parts between ranks"):
            for c in range(min(depth, chunks)):
                for end in ends:
                    end.post(c, errors)
            for c in range(chunks):
                for end in ends:
                    end.finish(c, errors)
                for end in reversed(ends):  # sends first: their reads overlap chunk c's writes
                    end.post(c + depth, errors)
                if c == 0:
                    fault_point("local-replicating")
    finally:
        for end in ends:
            end.close(errors)
        if writer is not None:
            writer.shutdown(wait=True)
    moved = sum(t.size for t in transfers if rank in (t.src, t.dst))
    log.debug(
        "rank %d moved %d bytes in %d transfers in %.2fs",
        rank,
        moved,
        len(ends),
        time.perf_counter() - start,
    )
    return errors


class _End:
    """This rank's end of one transfer: `depth` buffers, the chunks posted and not finished."""

    def __init__(
        self,
        i: int,
        t: Transfer,
        stream: Any,
        group: dist.ProcessGroup | None,
        chunk: int,
        depth: int,
        clock: PhaseClock | None,
    ) -> None:
        self.i, self.t, self.stream, self.group = i, t, stream, group
        self.chunk, self.depth = chunk, depth
        self.clock = clock or PhaseClock()
        self.chunks = -(-t.size // chunk)
        self.bufs = [_page_aligned(min(chunk, t.size)) for _ in range(min(depth, self.chunks))]
        self.works: dict[int, Any] = {}

    def view(self, c: int) -> torch.Tensor:
        """The buffer of chunk `c`, cut to that chunk's length (a contiguous view)."""
        return self.bufs[c % self.depth][: min(self.chunk, self.t.size - c * self.chunk)]

    def peer(self, rank: int) -> int:
        return tdist.get_global_rank(self.group, rank) if self.group is not None else rank

    def tag(self, c: int) -> int:
        """One tag per (transfer, buffer): messages of one tag between one pair stay in order."""
        return self.i * self.depth + c % self.depth

    def post(self, c: int, errors: dict[int, BaseException]) -> None:
        raise NotImplementedError

    def finish(self, c: int, errors: dict[int, BaseException]) -> None:
        raise NotImplementedError

    def close(self, errors: dict[int, BaseException]) -> None:
        """Close the stream (a chunk still in flight after a dead peer keeps its buffer alive
        through its gloo work, so nothing is freed under it)."""
        if self.stream is not None:
            try:
                with self.clock("receive close" if isinstance(self, _Incoming) else "send read"):
                    self.stream.close()
            except Exception as e:
                errors.setdefault(self.i, e)
            self.stream = None


class _Outgoing(_End):
    def post(self, c: int, errors: dict[int, BaseException]) -> None:
        """Read chunk `c` into its buffer (zeros once the source failed) and send it."""
        if c >= self.chunks:
            return
        buf = self.view(c)
        if self.stream is not None:
            try:
                with self.clock("send read"):
                    got = self.stream.readinto(buf.numpy().data)
                if got != len(buf):
                    raise EOFError(f"expected {len(buf)} more bytes, the file ended after {got}")
            except Exception as e:
                errors[self.i] = e
                _close_quietly(self.stream)
                self.stream = None
        if self.stream is None:
            buf.zero_()
        self.works[c] = tdist.isend(buf, self.peer(self.t.dst), group=self.group, tag=self.tag(c))

    def finish(self, c: int, errors: dict[int, BaseException]) -> None:
        """Wait until chunk `c` has left its buffer."""
        work = self.works.pop(c, None)
        if work is not None:
            with self.clock("send wait"):
                work.wait()


class _Incoming(_End):
    def __init__(
        self,
        i: int,
        t: Transfer,
        stream: Any,
        group: dist.ProcessGroup | None,
        chunk: int,
        depth: int,
        clock: PhaseClock | None,
        writer: ThreadPoolExecutor,
    ) -> None:
        super().__init__(i, t, stream, group, chunk, depth, clock)
        self.writer = writer
        self.written: dict[int, Future[None]] = {}
        self.failure: BaseException | None = None
        """The sink's first error, set on the writer thread."""

    def post(self, c: int, errors: dict[int, BaseException]) -> None:
        """Receive chunk `c` into its buffer, once the writer is done with the chunk before."""
        if c < self.chunks:
            self.wait_written(c - self.depth, errors)
            buf = self.view(c)
            self.works[c] = tdist.irecv(
                buf, self.peer(self.t.src), group=self.group, tag=self.tag(c)
            )

    def finish(self, c: int, errors: dict[int, BaseException]) -> None:
        """Wait for chunk `c` and hand it to the writer (chunk `c + 1` arrives meanwhile)."""
        work = self.works.pop(c, None)
        if work is None:
            return
        with self.clock("receive wait"):
            work.wait()
        if self.stream is not None:
            self.written[c] = self.writer.submit(self._write, c)

    def _write(self, c: int) -> None:
        """Write chunk `c` to the sink (on the writer thread, chunks in order). After a
        failure the chunks are still received, and dropped."""
        if self.failure is not None or self.stream is None:
            return
        try:
            with self.clock("receive write"):
                self.stream.write(self.view(c).numpy().data)
        except Exception as e:
            self.failure = e

    def wait_written(self, c: int, errors: dict[int, BaseException]) -> None:
        """Wait until the writer is done with chunk `c` (its buffer is free again); a failed
        sink is reported and closed."""
        done = self.written.pop(c, None)
        if done is not None:
            with self.clock("write wait"):
                done.result()
        if self.failure is not None and self.stream is not None:
            errors[self.i] = self.failure
            _close_quietly(self.stream)
            self.stream = None

    def close(self, errors: dict[int, BaseException]) -> None:
        """Wait for every chunk handed to the writer, then close the sink."""
        for c in sorted(self.written):
            self.wait_written(c, errors)
        super().close(errors)


def _page_aligned(size: int) -> torch.Tensor:
    """A uint8 tensor of `size` bytes in its own anonymous mapping: page-aligned, so a sink
    writing with `O_DIRECT` (`storage/direct_file.py`) writes from it in place."""
    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)


def _open(
    opener: Callable[[Transfer], Source | Sink],
    t: Transfer,
    i: int,
    errors: dict[int, BaseException],
) -> Any:
    try:
        return opener(t)
    except Exception as e:
        errors[i] = e
        return None


def _close_quietly(stream: Source | Sink | None) -> None:
    """Close a stream that already failed (its first error is the one reported)."""
    try:
        if stream is not None:
            stream.close()
    except Exception as e:
        log.debug("closing a failed transfer stream: %s", e)
