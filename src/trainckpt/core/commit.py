"""The commit protocol (docs/design.md §4): how a save becomes a checkpoint, or leaves nothing
behind.

One protocol per kind of target, each reading top to bottom (`commit_rename.py` on filesystems,
`commit_object_store.py` on object stores, the steps they share in `commit_steps.py`): lock or
claim the step, every rank writes its files (`rank_write.py`: what a rank writes, and the
agreements and fault points inside), all ranks agree, then rank 0 writes `.manifest.json`,
checks that every file it lists is there with its size, and writes `.metadata.json`; a folder
without `.metadata.json` is never a checkpoint, whatever else it holds. On object stores a save
first claims its step (`claim.py`), so two saves of one step never write into the same prefix.
`Checkpointer` calls `save_checkpoint` once; nothing here calls back into it. Deleting a step
folder (prune, retention) takes the same lock or claim, and lives here too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from trainckpt.core import claim as claims
from trainckpt.core.commit_object_store import save_to_object_store
from trainckpt.core.commit_rename import save_by_rename
from trainckpt.core.commit_steps import SaveRequest, wait_for
from trainckpt.core.rank_write import RankFiles
from trainckpt.core.step_lock import StepLock
from trainckpt.errors import ConcurrentSaveError
from trainckpt.format.folder import delete_step_folder, is_committed
from trainckpt.format.layout import target_name
from trainckpt.storage import Storage

__all__ = [
    "SaveRequest",
    "delete_checkpoint",
    "delete_leftover",
    "save_checkpoint",
    "wait_for",
]

log = logging.getLogger(__name__)


def save_checkpoint(req: SaveRequest, files: RankFiles) -> str:
    """Save this rank's `files` through the protocol that fits the target's back end; return
    the committed path.

    Called on: all ranks.
    """
    if req.storage.atomic_rename:
        return save_by_rename(req, files)
    return save_to_object_store(req, files)


def delete_leftover(storage: Storage, dir: str) -> bool:
    """Delete an uncommitted step folder (a leftover of an interrupted save), unless it turns
    out to be a save in progress or got committed meanwhile; return whether it was deleted.
    The deletion claims the step first: the step lock on a filesystem (`step_lock.py`), the
    claim on object stores (`claim.delete_uncommitted`).

    Called on: the one process deleting (prune, retention).
    """
    if not storage.atomic_rename:
        return claims.delete_uncommitted(storage, dir)
    try:
        with _deletion_lock(storage, dir):
            name = storage.name(dir)
            if target_name(name) == name and is_committed(storage, dir):
                return False  # a save that held the lock committed it meanwhile
            delete_step_folder(storage, dir)
    except ConcurrentSaveError as e:
        log.info("keeping '%s': %s", dir, e)
        return False
    return True


def delete_checkpoint(storage: Storage, path: str) -> None:
    """Delete a checkpoint folder (committed or not, or a `-tmp` working folder), commit
    record first (`folder.delete_step_folder`). On a filesystem the deletion locks the step
    first (`step_lock.py`): the folders of a save still running are never deleted
    (`ConcurrentSaveError`), those of a crashed one are. Called on: one process."""
    start = time.perf_counter()
    with _deletion_lock(storage, path):
        delete_step_folder(storage, path)
    log.info("deleted '%s' in %.2fs", path, time.perf_counter() - start)


@contextmanager
def _deletion_lock(storage: Storage, path: str) -> Iterator[None]:
    """Hold the step lock of `path` (a step folder or its `-tmp`) on a filesystem; nothing on
    object stores (their deletions take the claim: `claim.delete_uncommitted`)."""
    local = storage.local_path(path) if storage.atomic_rename else None
    if local is None or not local.parent.is_dir():
        yield  # object store, or nothing there to delete
        return
    lock = StepLock(local.parent / target_name(local.name), f"deletion of '{path}'")
    if not lock.take():
        raise ConcurrentSaveError(
            f"not deleting '{path}': {lock.folder.name} is locked by a running save or "
            f"deletion ({lock.holder()}), so it is no leftover. Delete it after that one ends"
        )
    try:
        yield
    finally:
        lock.release()
