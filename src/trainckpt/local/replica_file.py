"""How a disk takes replicas: past the page cache (`O_DIRECT`) or through it, decided once per
disk by measuring both, and the file writer of each way.

A replica is written now and read only after a failure. `O_DIRECT` skips the copy into the page
cache and leaves the training run's cached pages alone, but each write waits for the disk; on
many disks (this project's ext4 on virtio among them) writing through the page cache, with
writeback started as each chunk lands and an fsync at the end, is as fast or faster. So the
first rank of each disk times both ways once (`PROBE_BYTES` each, twice, alternating) and keeps
the verdict in `<local_dir>/.write-mode.json`; `O_DIRECT` is used only where it took at most
`MARGIN` of the page cache's time. Through the page cache, each chunk's writeback starts as it
is written and the written pages are dropped once durable (`POSIX_FADV_DONTNEED`), so replicas
do not crowd the cache either. Called on: the first rank of each disk (`decide`), every rank
(`read_mode`, `replica_file`).
"""

from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

from trainckpt.storage.checksummed_file import crc32c_extend
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.direct_file import direct_file
from trainckpt.storage.local import writing

log = logging.getLogger(__name__)

MODE_FILE = ".write-mode.json"
PROBE_BYTES = 32 << 20
"""Bytes written per probe (each way, twice)."""
PROBE_CHUNK = 16 << 20
"""Bytes per write in a probe: a replica's transfer chunk."""
MARGIN = 0.9
"""`O_DIRECT` is chosen only when it takes at most this share of the page cache's time."""


@dataclass(frozen=True)
class WriteMode:
    """The verdict for one disk, with the times it rests on (seconds per probe, the faster of
    two; `direct_seconds` is None where the filesystem refuses `O_DIRECT`)."""

    direct: bool
    page_seconds: float
    direct_seconds: float | None
    probe_bytes: int


class ReplicaWriter(Protocol):
    def write(self, data: memoryview) -> int: ...

    def entry(self) -> FileEntry: ...


def decide(root: Path) -> WriteMode:
    """The write mode of the disk under `root`: the one kept in `MODE_FILE`, or else measured
    now and kept there. Called on: the first rank of each disk, at start-up."""
    kept = read_mode(root)
    if kept is not None:
        return kept
    for stale in root.glob(".write-probe.*.tmp"):  # of a probe that crashed
        stale.unlink(missing_ok=True)
    page: list[float] = []
    direct: list[float] = []
    buf = mmap.mmap(-1, PROBE_CHUNK)  # page-aligned, as the transfer buffers are
    buf.write(os.urandom(PROBE_CHUNK))
    try:
        for way in (False, True, True, False):
            seconds = _probe(root, way, memoryview(buf))
            if seconds is None:  # no O_DIRECT here
                direct.clear()
                break
            (direct if way else page).append(seconds)
        if not page:
            page.append(_probe(root, False, memoryview(buf)) or 0.0)
    finally:
        buf.close()
    fastest_direct = min(direct) if len(direct) == 2 else None
    mode = WriteMode(
        direct=fastest_direct is not None and fastest_direct <= MARGIN * min(page),
        page_seconds=min(page),
        direct_seconds=fastest_direct,
        probe_bytes=PROBE_BYTES,
    )
    tmp = root / f"{MODE_FILE}.{secrets.token_hex(4)}.tmp"
    with writing(root / MODE_FILE):
        tmp.write_text(json.dumps(asdict(mode)))
        os.replace(tmp, root / MODE_FILE)
    log.info(
        "local tier: replicas under '%s' are written %s (%d MB: page cache + fsync %.3fs, "
        "O_DIRECT %s); delete '%s' to measure again",
        root,
        "past the page cache (O_DIRECT)" if mode.direct else "through the page cache",
        PROBE_BYTES >> 20,
        mode.page_seconds,
        "refused" if fastest_direct is None else f"{fastest_direct:.3f}s",
        root / MODE_FILE,
    )
    return mode


def read_mode(root: Path) -> WriteMode | None:
    """The kept verdict for the disk under `root`, or None (none yet, or unreadable: then it is
    measured again). Called on: every rank, after its disk's first rank decided."""
    try:
        return WriteMode(**json.loads((root / MODE_FILE).read_text()))
    except (OSError, ValueError, TypeError) as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("local tier: '%s' unreadable (%s), measuring again", root / MODE_FILE, e)
        return None


def _probe(root: Path, direct: bool, chunk: memoryview) -> float | None:
    """Seconds to write and fsync `PROBE_BYTES` one way (None: `O_DIRECT` refused here)."""
    path = root / f".write-probe.{secrets.token_hex(4)}.tmp"
    try:
        start = time.perf_counter()
        with replica_file(path, direct) as w:
            for _ in range(PROBE_BYTES // len(chunk)):
                w.write(chunk)
        if direct and not getattr(w, "direct", True):
            return None
        return time.perf_counter() - start
    finally:
        path.unlink(missing_ok=True)


@contextmanager
def replica_file(path: Path, direct: bool) -> Iterator[ReplicaWriter]:
    """Create `path` and yield its writer (size and CRC32C of the bytes as they go out); when
    the block ends the bytes are durable. `direct`: past the page cache where the filesystem
    allows (`storage/direct_file.py`), else through it (`_CacheWriter`)."""
    if direct:
        with direct_file(path) as w:
            yield w
        return
    with writing(path):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(path, flags, 0o644)
        try:
            writer = _CacheWriter(fd)
            yield writer
            os.fsync(fd)
            _start_writeback(fd, 0, 0)  # durable now: drops the clean pages
        finally:
            os.close(fd)


class _CacheWriter:
    """Sequential writes through the page cache; each write's writeback starts at once."""

    def __init__(self, fd: int) -> None:
        self._fd, self._crc, self._size = fd, 0, 0

    def write(self, data: memoryview) -> int:
        view = data.cast("B") if data.format != "B" else data
        self._crc = crc32c_extend(self._crc, view)
        written = 0
        while written < len(view):  # a large write to a regular file may be partial
            written += os.write(self._fd, view[written:])
        _start_writeback(self._fd, self._size, len(view))
        self._size += len(view)
        return len(view)

    def entry(self) -> FileEntry:
        return FileEntry(size=self._size, crc32c=f"{self._crc:08x}")


def _start_writeback(fd: int, offset: int, length: int) -> None:
    """`POSIX_FADV_DONTNEED` on a range (0: to the end): Linux starts writeback of its dirty
    pages, so the disk works while the next chunk arrives and the final fsync has less left to
    wait for, and drops its clean ones. Only advice: where it is missing nothing changes."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    try:
        advise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.ESPIPE):
            raise
