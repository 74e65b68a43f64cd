"""The commit protocol on local and shared filesystems (docs/design.md §4): rank 0 locks the
step and creates `<step>-tmp`, every rank writes its files there, rank 0 writes the records
into it and renames it into place (an old folder is moved aside first and deleted after).

Split from `commit.py`, which picks this protocol when the back end renames atomically.
Called on: all ranks (`save_by_rename`), rank 0 inside (prepare, commit).
"""

from __future__ import annotations

import logging
import os
import uuid

from trainckpt.core import dist
from trainckpt.core.commit_steps import (
    SaveRequest,
    exists_error,
    run_write,
    wait_for,
    write_records,
)
from trainckpt.core.incremental import Reuse
from trainckpt.core.rank_write import RankFiles, WriteTarget
from trainckpt.core.step_lock import StepLock
from trainckpt.errors import (
    CheckpointExistsError,
    CheckpointTimeoutError,
    ConcurrentSaveError,
    SharedFolderError,
)
from trainckpt.format.folder import delete_step_folder, is_abandoned, is_committed
from trainckpt.format.layout import METADATA_FILE, replaced_name, tmp_name
from trainckpt.storage import Storage
from trainckpt.storage.local import writing
from trainckpt.testing.faults import fault_point

log = logging.getLogger(__name__)

PROBE_PREFIX = ".probe-"


def save_by_rename(req: SaveRequest, files: RankFiles) -> str:
    storage, dir, group = req.storage, req.dir, req.group
    tmp = storage.join(storage.parent(dir), tmp_name(storage.name(dir)))
    # Rank 0 locks `dir` (and with it `-tmp`) for the whole save (`step_lock.py`): no other
    # save of this step, prune or retention touches either while it is held.
    lock = StepLock(storage.local_path(dir), f"save of '{dir}'")

    # 1. Prepare (rank 0): lock the step, refuse a committed target, clear crash leftovers,
    #    create `-tmp` with a probe file. Every rank gets rank 0's outcome, so all stop on a
    #    refusal.
    try:
        token = dist.run_on_rank0(
            lambda: _prepare_tmp(storage, dir, tmp, req.overwrite, lock),
            f"preparing '{tmp}'",
            group,
        )
        return _write_and_rename(req, files, tmp, token)
    except BaseException:
        if lock.held:  # rank 0, owner of `-tmp`: leave none behind a failed save
            try:
                storage.delete_tree(tmp)
            except Exception as cleanup_error:
                log.warning("could not remove '%s' after a failed save: %s", tmp, cleanup_error)
        raise
    finally:
        lock.release()


def _write_and_rename(req: SaveRequest, files: RankFiles, tmp: str, token: str) -> str:
    """Steps 2-6 of `save_by_rename`, once `-tmp` exists. Called on: all ranks."""
    storage, dir, group = req.storage, req.dir, req.group

    # 2. Every rank must see the probe before anything is written: a rank that never sees it
    #    is on a node whose folder is not shared, and would write its shards somewhere else.
    probe = storage.local_path(storage.join(tmp, PROBE_PREFIX + token))
    seen = wait_for(probe.exists, req.fs_timeout)
    dist.agree(
        None
        if seen
        else SharedFolderError(
            f"rank {dist.get_rank(group)} does not see '{probe}', written by rank 0 "
            f"{req.fs_timeout:.0f}s ago: the save folder '{storage.parent(dir)}' is not shared "
            "by all ranks. Use a shared filesystem (NFS) or a gs:// folder, with work_dir on "
            "the local disk for staging"
        ),
        "checking that the save folder is shared",
        group,
    )

    # 3. Every rank writes its files into `-tmp`, each fsynced (`rank_write.py`: its trainer
    #    state, an agreement that every rank wrote it, fault point `writing-shards`, its DCP
    #    shards; an incremental save hard-links its unchanged files from the previous
    #    checkpoint instead, `incremental.py`). A failure on any rank stops all.
    to = WriteTarget(storage.local_path(tmp), durable=True, reuse=Reuse(storage, tmp))
    entries, error = run_write(files, to)
    fault_point("after-shards")
    dist.agree(error, f"writing checkpoint files into '{tmp}'", group)

    # 4. Gathering every rank's file list is also the barrier after which all files are durable.
    parts = dist.all_gather_object(entries, group)

    # 5. Rank 0 checks that `-tmp` holds exactly the files the ranks wrote, writes the manifest
    #    and then the commit record into it (never into a recreated copy), and renames it into
    #    place. The rename never replaces a checkpoint another writer put there meanwhile.
    def commit() -> None:
        storage.delete_files([storage.join(tmp, PROBE_PREFIX + token)])
        write_records(req, tmp, parts)  # checks that `-tmp` holds exactly `parts` first
        _swap_in(storage, tmp, dir)

    dist.run_on_rank0(commit, f"committing '{dir}'", group)

    # 6. Shared filesystems can lag: every rank waits until it sees the committed folder.
    target = storage.local_path(storage.join(dir, METADATA_FILE))
    if not wait_for(target.exists, req.fs_timeout):
        raise CheckpointTimeoutError(
            f"rank {dist.get_rank(group)} waited {req.fs_timeout:.0f}s for '{target}' "
            "to appear after rank 0 committed it; the shared filesystem is lagging or not shared"
        )
    return dir


def _swap_in(storage: Storage, tmp: str, dir: str) -> None:
    """Rename the complete `tmp` to `dir`. An old folder at `dir` (a checkpoint being
    overwritten with save_overwrite, one a rollback abandoned, or an uncommitted leftover) is
    first moved aside to `<dir>-replaced` and deleted only after the rename, so at every moment
    the old folder or the new checkpoint exists whole. A crash between the two renames leaves
    both (the next save of the step puts the old one back). Called on: rank 0, holding the
    step lock."""
    replaced = storage.join(storage.parent(dir), replaced_name(storage.name(dir)))
    fault_point("before-rename")
    old = os.path.lexists(storage.local_path(dir))
    if old:
        storage.rename_dir(dir, replaced)
        fault_point("replacing")
    try:
        storage.rename_dir(tmp, dir)
    except CheckpointExistsError as e:
        raise CheckpointExistsError(
            f"'{dir}' appeared while this save was writing (a writer that does not take "
            f"trainckpt's lock of the step); this save committed nothing: {e}"
        ) from e
    fault_point("after-rename")
    if old:
        delete_step_folder(storage, replaced)


def _prepare_tmp(storage: Storage, dir: str, tmp: str, overwrite: bool, lock: StepLock) -> str:
    """Lock the step, then clear what a crashed save left and create `tmp`. Called on: rank 0."""
    local_dir, local_tmp = storage.local_path(dir), storage.local_path(tmp)
    with writing(local_tmp):
        local_dir.parent.mkdir(parents=True, exist_ok=True)
    if not lock.take():
        if is_committed(storage, dir) and not overwrite:
            raise exists_error(dir)
        raise ConcurrentSaveError(
            f"another save of {storage.name(dir)} is in progress in '{tmp}' "
            f"({lock.holder()}); this save did not start. Wait for that one to finish, or "
            "save to another step"
        )
    if is_committed(storage, dir) and not overwrite:
        raise exists_error(dir)
    # The lock was free: whatever is here was left by a process that died (or by a deletion
    # that was interrupted), or abandoned by a rollback. An old folder of the step stays until
    # the new one is complete (`_swap_in`); a swap a crash interrupted is undone first.
    replaced = storage.join(storage.parent(dir), replaced_name(storage.name(dir)))
    if os.path.lexists(storage.local_path(replaced)):
        if os.path.lexists(local_dir):  # the swap was done: what is left is the old folder
            storage.delete_tree(replaced)
        else:
            log.warning("'%s': putting back the old folder a crashed save had moved aside", dir)
            storage.rename_dir(replaced, dir)
    if os.path.lexists(local_dir) and not is_committed(storage, dir):
        log.warning(
            "'%s' is %s; this save replaces it once it is complete",
            dir,
            "abandoned by a rollback"
            if is_abandoned(storage, dir)
            else "an uncommitted leftover of an interrupted save or deletion",
        )
    if os.path.lexists(local_tmp):
        log.warning("removing '%s': the working folder of an interrupted save", tmp)
        storage.delete_tree(tmp)
    with writing(local_tmp):
        local_tmp.mkdir()
    token = uuid.uuid4().hex
    storage.write_bytes(storage.join(tmp, PROBE_PREFIX + token), b"", make_parents=False)
    return token
