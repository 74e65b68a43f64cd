"""Local and shared (NFS) filesystems."""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from .base import Listing, Storage


def fsync_dir(path: Path) -> None:
    """Make a folder's entries (created, renamed or removed children) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        return Listing(dirs=sorted(dirs), files=files)

    def list_files(self, location: str) -> dict[str, int]:
        root = Path(location)
        if not root.is_dir():
            raise CheckpointNotFoundError(f"folder '{location}' does not exist")
        out: dict[str, int] = {}
        for dirpath, _dirnames, filenames in os.walk(root):
            for fname in filenames:
                p = Path(dirpath) / fname
                out[p.relative_to(root).as_posix()] = p.stat().st_size
        return out

    def size(self, location: str) -> int:
        try:
            st = os.stat(location)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise CheckpointNotFoundError(f"'{location}' does not exist") from e
        if not os.path.isfile(location):
            raise CheckpointNotFoundError(f"'{location}' is not a file")
        return st.st_size

    def read_bytes(self, location: str, start: int = 0, end: int | None = None) -> bytes:
        try:
            with open(location, "rb") as f:
                f.seek(start)
                return f.read() if end is None else f.read(end - start)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise CheckpointNotFoundError(f"'{location}' does not exist") from e
        except IsADirectoryError as e:
            raise CheckpointNotFoundError(f"'{location}' is a folder, not a file") from e

    def open_read(self, location: str) -> BinaryIO:
        try:
            return open(location, "rb")
        except (FileNotFoundError, NotADirectoryError) as e:
            raise CheckpointNotFoundError(f"'{location}' does not exist") from e

    def local_copy(self, location: str, cache_dir: Path) -> Path:
        if not os.path.isfile(location):
            raise CheckpointNotFoundError(f"'{location}' does not exist")
        return Path(location)

    # -- writing -----------------------------------------------------------------------------
    def write_bytes(self, location: str, data: bytes, *, overwrite: bool = True) -> None:
        target = Path(location)
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
        for parent in parents:
            if os.path.isdir(parent):
                fsync_dir(Path(parent))

    def _remove_empty_dirs(self, location: str) -> None:
        shutil.rmtree(location, ignore_errors=True)

    def rename_dir(self, src: str, dst: str) -> None:
        try:
            os.rename(src, dst)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise CheckpointExistsError(
                    f"cannot rename '{src}' to '{dst}': the target exists"
                ) from e
            raise StorageError(f"cannot rename '{src}' to '{dst}': {e}") from e
        fsync_dir(Path(dst).parent)
