"""Local and shared (NFS) filesystems.

Every `OSError` of a read or a write leaves as a `CheckpointError` naming the path: a missing
path as `CheckpointNotFoundError`, anything else (no space, read-only filesystem, permission
denied, a file where a folder should be) as `StorageError` with advice for what failed: a write
names space, permissions and another folder; a read names permissions. `writing` and `reading`
are shared with the DCP shard writer, which writes local files on its own.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import shutil
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

from trainckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    StorageError,
)
from trainckpt.storage.base import Listing, Storage

_WRITE_ADVICE = {
    errno.ENOSPC: "no space left on the device: free space, or save to a folder on another disk",
    errno.EDQUOT: "disk quota exceeded: free space, or save to a folder on another disk",
    errno.EROFS: "the filesystem is read-only: save to a writable folder",
    errno.EACCES: "permission denied: give this user write access to the folder, "
    "or save to another folder",
    errno.EPERM: "operation not permitted: give this user write access to the folder, "
    "or save to another folder",
}


_NO_LINK = frozenset(
    {errno.EXDEV, errno.EPERM, errno.EACCES, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK}
)
"""Why `os.link` may refuse where a byte copy still works: another filesystem, a filesystem
without hard links (some FUSE and SMB mounts, or links forbidden by policy), too many links."""


def write_failure(path: str | Path, e: OSError, verb: str = "write") -> StorageError:
    """The `StorageError` for a failed write (or `verb`: delete, rename) of `path`: what
    failed and what to do."""
    blocker = _file_in_the_way(Path(path))
    if blocker is not None:
        return StorageError(
            f"cannot {verb} '{path}': '{blocker}' is a file, not a folder; "
            "move it away, or choose another save folder"
        )
    advice = _WRITE_ADVICE.get(e.errno or 0) or (
        f"{e.strerror or e}: check the disk and its permissions, or save to another folder"
    )
    if e.errno == errno.EFBIG:
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft} bytes"
        advice = (
            "the file is too large for this filesystem or for the process's file-size limit "
            f"(RLIMIT_FSIZE, ulimit -f: {limit}): raise the limit, or save to another folder"
        )
    return StorageError(f"cannot {verb} '{path}': {advice}")


def read_failure(path: str | Path, e: OSError) -> StorageError:
    """The `StorageError` for a failed read of `path` (other than a missing file)."""
    if e.errno in (errno.EACCES, errno.EPERM):
        advice = "permission denied: give this user read access to it (and its folders)"
    else:
        advice = f"{e.strerror or e}: check the disk, or restore the file from a copy"
    return StorageError(f"cannot read '{path}': {advice}")


@contextmanager
def writing(path: str | Path) -> Iterator[None]:
    """Turn an `OSError` raised while writing `path` into a `StorageError` with write advice
    (`CheckpointNotFoundError` when its folder vanished); errors of our family (e.g.
    `CheckpointExistsError`) pass unchanged."""
    try:
        yield
    except CheckpointError:
        raise
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"cannot write '{path}': its folder does not exist (any more); something deleted "
            "it while it was being written"
        ) from e
    except OSError as e:
        raise write_failure(path, e) from e


@contextmanager
def reading(path: str | Path) -> Iterator[None]:
    """Turn an `OSError` raised while reading `path` into our family: a missing path (or a
    file where a folder should be) is `CheckpointNotFoundError`, the rest `StorageError`."""
    try:
        yield
    except CheckpointError:
        raise
    except (FileNotFoundError, NotADirectoryError) as e:
        raise CheckpointNotFoundError(f"'{path}' does not exist") from e
    except IsADirectoryError as e:
        raise CheckpointNotFoundError(f"'{path}' is a folder, not a file") from e
    except OSError as e:
        raise read_failure(path, e) from e


def _file_in_the_way(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a folder (so nothing can be
    created below it), else None."""
    for parent in path.parents:
        try:
            if parent.is_dir():
                return None
            if parent.exists() or parent.is_symlink():
                return parent
        except OSError:
            return None
    return None


log = logging.getLogger(__name__)


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (created, renamed or removed children) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _under(root: Path, location: str) -> bool:
    """True when the folder holding `location` is `root` or below it, links resolved."""
    real_root = os.path.realpath(root)
    parent = os.path.realpath(os.path.dirname(location))
    return parent == real_root or parent.startswith(real_root + os.sep)


def _ignore_vanished(func: Any, path: str, exc_info: Any) -> None:
    """`shutil.rmtree` error handler: what is already gone is fine, anything else raises."""
    error = exc_info[1]
    if isinstance(error, FileNotFoundError):
        return
    raise write_failure(path, error, verb="delete") from error


class LocalStorage(Storage):
    """Paths on a local or shared filesystem. `file://` URLs are accepted and stripped."""

    atomic_rename = True

    def normalize(self, location: str) -> str:
        if location.startswith("file://"):
            location = location[len("file://") :]
        return os.path.normpath(os.path.abspath(os.path.expanduser(location)))

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)

    def parent(self, location: str) -> str:
        return os.path.dirname(location)

    def name(self, location: str) -> str:
        return os.path.basename(location)

    def local_path(self, location: str) -> Path:
        return Path(location)

    # -- reading -----------------------------------------------------------------------------
    def list_dir(self, location: str) -> Listing:
        dirs: list[str] = []
        files: dict[str, int] = {}
        try:
            with os.scandir(location) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        dirs.append(entry.name)
                    elif entry.is_file():
                        files[entry.name] = entry.stat().st_size
        except FileNotFoundError as e:
            raise CheckpointNotFoundError(f"folder '{location}' does not exist") from e
        except NotADirectoryError as e:
            raise CheckpointNotFoundError(
                f"'{location}' is a file, not a folder: pass the folder that holds checkpoints"
            ) from e
        except OSError as e:
            raise read_failure(location, e) from e
        return Listing(dirs=sorted(dirs), files=files)

    def list_files(self, location: str) -> dict[str, int]:
        root = Path(location)
        if not root.is_dir():
            raise CheckpointNotFoundError(f"folder '{location}' does not exist")

        def fail(e: OSError) -> None:
            if isinstance(e, FileNotFoundError):
                return  # a folder deleted since its parent was read
            raise read_failure(e.filename or location, e) from e

        out: dict[str, int] = {}
        with reading(location):
            for dirpath, _dirnames, filenames in os.walk(root, onerror=fail):
                for fname in filenames:
                    p = Path(dirpath) / fname
                    try:
                        out[p.relative_to(root).as_posix()] = p.stat().st_size
                    except FileNotFoundError:  # deleted since the folder was read, or a dead link
                        continue
        return out

    def size(self, location: str) -> int:
        with reading(location):
            st = os.stat(location)
        if not os.path.isfile(location):
            raise CheckpointNotFoundError(f"'{location}' is not a file")
        return st.st_size

    def read_bytes(self, location: str, start: int = 0, end: int | None = None) -> bytes:
        with reading(location), open(location, "rb") as f:
            if end is not None:  # never allocate more than the file holds
                end = min(end, os.fstat(f.fileno()).st_size)
            f.seek(start)
            return f.read() if end is None else f.read(max(0, end - start))

    def open_read(self, location: str) -> BinaryIO:
        with reading(location):
            return open(location, "rb")

    def local_copy(self, location: str, cache_dir: Path) -> Path:
        if not os.path.isfile(location):
            raise CheckpointNotFoundError(f"'{location}' does not exist")
        return Path(location)

    # -- writing -----------------------------------------------------------------------------
    def write_bytes(
        self, location: str, data: bytes, *, overwrite: bool = True, make_parents: bool = True
    ) -> None:
        target = Path(location)
        with writing(target):
            if make_parents:  # else a vanished folder is CheckpointNotFoundError (`writing`)
                target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                self._publish(tmp, target, overwrite=overwrite)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(target.parent)

    def upload(self, local: Path, location: str, *, overwrite: bool = True) -> None:
        target = Path(location)
        if target.resolve() == Path(local).resolve():
            return
        with writing(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
            try:
                shutil.copyfile(local, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
                self._publish(tmp, target, overwrite=overwrite)
            finally:
                tmp.unlink(missing_ok=True)
            fsync_dir(target.parent)

    def copy_file(self, src: str, dst: str) -> None:
        """A hard link when the filesystem allows one, else a byte copy (published create-only,
        as `upload` does)."""
        target = Path(dst)
        if not os.path.isfile(src):
            raise CheckpointNotFoundError(f"cannot copy '{src}': it does not exist (as a file)")
        with writing(target):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                self._link_or_copy(Path(src), target)
            except FileExistsError as e:
                raise CheckpointExistsError(
                    f"cannot copy '{src}' to '{dst}': the target exists; remove it first"
                ) from e
            fsync_dir(target.parent)

    def _link_or_copy(self, src: Path, target: Path) -> None:
        try:
            os.link(src, target)
            return
        except OSError as e:
            if e.errno not in _NO_LINK:
                raise
            log.debug("'%s' cannot be linked (%s); copying its bytes", src, e.strerror)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            shutil.copyfile(src, tmp)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            self._publish(tmp, target, overwrite=False)
        finally:
            tmp.unlink(missing_ok=True)

    @staticmethod
    def _publish(tmp: Path, target: Path, *, overwrite: bool) -> None:
        """Move a finished temp file into place; create-only when not `overwrite`."""
        if overwrite:
            os.replace(tmp, target)
            return
        try:
            os.link(tmp, target)  # fails atomically if target exists, unlike rename
        except FileExistsError as e:
            raise CheckpointExistsError(
                f"'{target}' already exists; pass save_overwrite=True to replace it"
            ) from e

    def delete_files(self, locations: Iterable[str]) -> None:
        parents = set()
        for loc in locations:
            try:
                os.unlink(loc)
                parents.add(os.path.dirname(loc))
            except FileNotFoundError:
                pass
            except IsADirectoryError:
                shutil.rmtree(loc, ignore_errors=True)
            except OSError as e:
                raise write_failure(loc, e, verb="delete") from e
        for parent in parents:
            if os.path.isdir(parent):
                fsync_dir(Path(parent))

    def delete_tree(self, location: str, first: Iterable[str] = ()) -> None:
        """As `Storage.delete_tree`, and never through a symbolic link: when `location` is one,
        only the link is removed; links inside are removed as links, and a file in `first` is
        deleted only where no link leads out of `location` on the way."""
        root = Path(location)
        if root.is_symlink():
            log.warning(
                "'%s' is a symbolic link (to '%s'): removing the link only, never what it "
                "points to",
                location,
                os.readlink(root),
            )
            root.unlink(missing_ok=True)
            fsync_dir(root.parent)
            return
        inside = [rel for rel in first if _under(root, self.join(location, rel))]
        super().delete_tree(location, first=inside)

    def _remove_empty_dirs(self, location: str) -> None:
        # what `list_files` left: folders, and links to folders (removed as links)
        shutil.rmtree(location, onerror=_ignore_vanished)

    def rename_dir(self, src: str, dst: str) -> None:
        try:
            os.rename(src, dst)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise CheckpointExistsError(
                    f"cannot rename '{src}' to '{dst}': the target exists"
                ) from e
            raise write_failure(dst, e, verb=f"rename '{src}' to") from e
        fsync_dir(Path(dst).parent)
