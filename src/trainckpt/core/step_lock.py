"""Local and shared filesystems: one save (or deletion) of a step folder at a time.

The lock is a POSIX record lock (`fcntl.lockf`) on a hidden lock file beside the checkpoint
folder (`<save>/.step1000.lock`, `layout.lock_name`). (Object stores, which have no locks, use
the leases of `claim.py` instead.) Rank 0 of a save holds it from clearing
crash leftovers to the rename that commits; a deletion (`Checkpointer.delete`: retention,
`prune`) holds it while it deletes. The kernel drops the lock when its process dies, even on
SIGKILL, so a `stepN-tmp` whose lock can be taken is a crash leftover and may be cleared, and
one whose claim is held belongs to a live save and is left alone. Works on local disks and NFS
(the lock goes through the NFS lock protocol: NLM for v3, built into v4).

The lock file is removed when the lock is released, while still locked: a process that opened
it just before and locks it afterwards sees that the path no longer names the file it locked,
and retries with a fresh one. A crash leaves the file behind, unlocked; the next lock of that
folder takes it over and removes it.

The holder describes itself in the lock file (for the messages of those refused) while it also
holds a second lock, on byte 1 (the step lock is byte 0), which it drops once the description
is written: a refused process takes that byte shared, blocking, before it reads the description,
so it never reads the file between the holder's lock and its description.

POSIX locks belong to a process, not to a file handle: another thread of the same process would
get the lock from the kernel too (and its close would drop the holder's). Locks this process
holds are therefore also recorded in `_held`, and refused before the kernel is asked.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import logging
import os
import socket
import threading
from pathlib import Path

from trainckpt.errors import StorageError
from trainckpt.format.layout import lock_name

log = logging.getLogger(__name__)

_held: dict[str, tuple[int, str]] = {}
"""Lock files locked by this process -> (pid that claimed it, its description). A forked child
inherits the dict, not the locks: entries of another pid do not count."""
_held_lock = threading.Lock()

_STEP = (1, 0)
"""(length, start) of the step lock: byte 0 of the lock file."""
_DESCRIBING = (1, 1)
"""(length, start) of the lock held while the holder writes its description: byte 1."""


class StepLock:
    """The lock of one checkpoint folder (its `-tmp` working folder goes with it).

    `take()` is non-blocking: it returns False at once when another live process (or another
    thread of this one) holds the lock. Called on: the one process that saves or deletes
    (rank 0 of a save)."""

    def __init__(self, folder: Path, purpose: str) -> None:
        self.folder = folder
        self.lock_file = folder.parent / lock_name(folder.name)
        self.purpose = purpose
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def take(self) -> bool:
        """Lock the folder; False when another live process or thread holds it. The parent
        folder must exist. Raises `StorageError` when the filesystem cannot lock."""
        key = _key(self.lock_file)
        with _held_lock:
            if self._fd is not None:
                return True
            if key in _held and _held[key][0] == os.getpid():
                return False
            fd = _lock(self.lock_file)
            if fd is None:
                return False
            self._fd = fd
            _held[key] = (os.getpid(), _describe(fd, self.purpose))
            fcntl.lockf(fd, fcntl.LOCK_UN, *_DESCRIBING)  # readers may read the description
        return True

    def release(self) -> None:
        """Remove the lock file, then drop the lock. Does nothing unless held."""
        with _held_lock:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            _held.pop(_key(self.lock_file), None)
            try:
                self.lock_file.unlink(missing_ok=True)
            except OSError as e:  # a leftover lock file is harmless: the next claim reuses it
                log.warning("could not remove the lock file '%s': %s", self.lock_file, e)
            finally:
                os.close(fd)

    def holder(self) -> str:
        """Who holds the lock, as the holder described itself (best effort, for messages)."""
        with _held_lock:
            mine = _held.get(_key(self.lock_file))
            if mine is not None and mine[0] == os.getpid():
                # never open the file here: closing it would drop this process's own lock
                return f"{mine[1]} (another thread of this process)"
            text = _read_description(self.lock_file)
        return text[:200] or "a live process (it has not described itself yet)"


def _read_description(path: Path) -> str:
    """The holder's description in the lock file, read once the holder has written it (the
    describing byte, taken shared, waits for that); "" when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH, *_DESCRIBING)
        return os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)  # drops the shared lock too


def _lock(path: Path) -> int | None:
    """An open descriptor of the file now at `path` holding the step lock and the describing
    lock (released by the caller once it described itself), or None when another process
    holds the step lock."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StorageError(
                f"cannot create the lock file '{path}' ({e}): the save folder must be "
                "writable by the process that saves or deletes checkpoints"
            ) from e
        try:
            # Blocking: a reader or another taker holds the describing byte for microseconds.
            fcntl.lockf(fd, fcntl.LOCK_EX, *_DESCRIBING)
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, *_STEP)
        except OSError as e:
            os.close(fd)  # drops a describing lock taken before the step lock was refused
            if e.errno in (errno.EACCES, errno.EAGAIN):
                return None
            raise StorageError(
                f"cannot lock '{path}' ({e}): the filesystem refuses file locks (NFS without "
                "its lock service?); trainckpt needs them to keep two saves of one step apart. "
                "Enable locking on the mount, or save to a gs:// or s3:// folder"
            ) from e
        if _names(path, fd):
            return fd
        os.close(fd)  # its holder released (and removed) it meanwhile: lock the new one


def _names(path: Path, fd: int) -> bool:
    """True when `path` still names the file open as `fd`."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _describe(fd: int, purpose: str) -> str:
    """Write who holds the lock into the lock file (for the messages of those refused)."""
    when = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    text = f"{purpose}, by pid {os.getpid()} on {socket.gethostname()} since {when}"
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, text.encode() + b"\n", 0)
    except OSError as e:  # only a description for error messages
        log.debug("could not describe the lock in its lock file: %s", e)
    return text


def _key(path: Path) -> str:
    return os.path.join(os.path.realpath(path.parent), path.name)
