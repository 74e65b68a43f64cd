"""The commit protocol (docs/design.md §4): how a save becomes a checkpoint, or leaves nothing
behind.

One function per kind of target, each reading top to bottom: lock or claim the step, every rank
writes its files (`rank_write.py`: what a rank writes, and the agreements and fault points
inside), all ranks agree, then rank 0 writes `.manifest.json`, checks that every file it lists
is there with its size, and writes `.metadata.json`; a folder without `.metadata.json` is never
a checkpoint, whatever else it holds. On object stores a save first claims its step
(`claim.py`), so two saves of one step never write into the same prefix. `Checkpointer` calls
`save_checkpoint` once; nothing here calls back into it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from trainckpt.core import claim as claims
from trainckpt.core import dist
from trainckpt.core.claim import Claim
from trainckpt.core.incremental import Reuse
from trainckpt.core.rank_write import RankFiles, WriteTarget
from trainckpt.core.step_lock import StepLock
from trainckpt.core.upload_turns import run_in_turns
from trainckpt.errors import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointTimeoutError,
    ConcurrentSaveError,
    CorruptCheckpointError,
    SharedFolderError,
)
from trainckpt.format.folder import delete_step_folder, is_abandoned, is_committed
from trainckpt.format.layout import (
    ABANDONED_FILE,
    CLAIM_FILE,
    MANIFEST_FILE,
    METADATA_FILE,
    replaced_name,
    target_name,
    tmp_name,
)
from trainckpt.format.records import CheckpointManifest, CheckpointMetadata
from trainckpt.storage import Storage
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.local import writing
from trainckpt.testing.faults import fault_point

log = logging.getLogger(__name__)

PROBE_PREFIX = ".probe-"


@dataclass(frozen=True)
class SaveRequest:
    storage: Storage
    dir: str
    step: int | None
    ephemeral: bool
    overwrite: bool
    group: dist.ProcessGroup | None
    fs_timeout: float
    work_dir: Path
    upload_threads: int = 8
    """Parallel uploads of one rank to an object store."""
    throttle_uploads: bool = False
    """Object stores: the ranks of a node upload in turns (`upload_turns.py`), after all of
    their files are written; otherwise each file is uploaded as soon as it is written."""
    claim_lease: float = claims.DEFAULT_LEASE
    """Object stores: lease of this save's claim on its step (`claim.py`)."""


def save_checkpoint(req: SaveRequest, files: RankFiles) -> str:
    """Save this rank's `files` through the protocol that fits the target's back end; return
    the committed path.

    Called on: all ranks.
    """
    if req.storage.atomic_rename:
        return _save_by_rename(req, files)
    return _save_to_object_store(req, files)


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


def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll `predicate` with backoff until it holds or `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    delay = 0.005
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    return True


# -- local and shared filesystems ----------------------------------------------------------------


def _save_by_rename(req: SaveRequest, files: RankFiles) -> str:
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
    """Steps 2-6 of `_save_by_rename`, once `-tmp` exists. Called on: all ranks."""
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
    entries, error = _run_write(files, to)
    fault_point("after-shards")
    dist.agree(error, f"writing checkpoint files into '{tmp}'", group)

    # 4. Gathering every rank's file list is also the barrier after which all files are durable.
    parts = dist.all_gather_object(entries, group)

    # 5. Rank 0 checks that `-tmp` holds exactly the files the ranks wrote, writes the manifest
    #    and then the commit record into it (never into a recreated copy), and renames it into
    #    place. The rename never replaces a checkpoint another writer put there meanwhile.
    def commit() -> None:
        storage.delete_files([storage.join(tmp, PROBE_PREFIX + token)])
        _write_records(req, tmp, parts)  # checks that `-tmp` holds exactly `parts` first
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
            raise _exists(dir)
        raise ConcurrentSaveError(
            f"another save of {storage.name(dir)} is in progress in '{tmp}' "
            f"({lock.holder()}); this save did not start. Wait for that one to finish, or "
            "save to another step"
        )
    if is_committed(storage, dir) and not overwrite:
        raise _exists(dir)
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


# -- object stores -----------------------------------------------------------------------------


def _save_to_object_store(req: SaveRequest, files: RankFiles) -> str:
    storage, dir, group = req.storage, req.dir, req.group

    # 1. Prepare (rank 0): refuse a committed target; claim the step (`claim.py`), so that no
    #    other save writes into this prefix; then clear what a crashed save left there, or,
    #    with save_overwrite, the old checkpoint, commit record first.
    held: list[tuple[Claim, bool]] = []
    dist.run_on_rank0(lambda: held.append(_prepare_prefix(req)), f"preparing '{dir}'", group)
    claim, replacing = held[0] if held else (None, False)
    try:
        entries = _write_and_upload(req, files)
        # 4. After every upload completed: rank 0 uploads the manifest, checks that it holds
        #    the claim still and that every listed file is there, then the commit record.
        parts = dist.all_gather_object(entries, group)

        def commit() -> None:
            assert claim is not None
            _write_records(req, dir, parts, attempt=claim.attempt, before_commit=claim.confirm)
            if replacing:  # the old folder of the step, kept until now (`_move_aside`)
                fault_point("replaced")
                _delete_aside(storage, _aside(storage, dir))
            claim.release()

        dist.run_on_rank0(commit, f"committing '{dir}'", group)
    except BaseException:
        if claim is not None:
            _abandon(storage, dir, claim)
        raise
    return dir


def _write_and_upload(req: SaveRequest, files: RankFiles) -> dict[str, FileEntry]:
    """Steps 2-3 of `_save_to_object_store`: every rank writes its files into a staging folder
    and uploads them (create-only) into the claimed prefix. Called on: all ranks."""
    storage, dir, group = req.storage, req.dir, req.group
    staging = req.work_dir / f"staging-{uuid.uuid4().hex[:12]}"
    with writing(staging):  # work_dir full, read-only or not ours: a StorageError naming it
        staging.mkdir(parents=True)
    try:
        # 2. Every rank writes its files into the staging folder (`rank_write.py`), not
        #    fsynced: the uploaded objects are the copies that must last. Unless uploads go in
        #    turns (`throttle_uploads`), each file is uploaded as soon as it is written.
        early = (
            None
            if req.throttle_uploads
            else _EarlyUploads(storage, staging, dir, req.upload_threads)
        )
        try:
            # Files taken over from the previous checkpoint are copied server-side straight
            # into the prefix (`incremental.py`): none of them is uploaded.
            reuse = Reuse(storage, dir)
            to = WriteTarget(
                staging,
                durable=False,
                upload_threads=req.upload_threads,
                on_file=early.submit if early else None,
                reuse=reuse,
            )
            entries, error = _run_write(files, to)
            uploads = [rel for rel in entries if rel not in reuse.done]
            fault_point("after-shards")
            dist.agree(error, f"writing checkpoint files into '{staging}'", group)

            # 3. Every rank uploads its (remaining) files; an upload error on any rank stops all.
            error = None
            try:
                if early is not None:
                    early.finish(uploads)
                else:
                    run_in_turns(
                        lambda: storage.upload_many(
                            [(staging / rel, storage.join(dir, rel)) for rel in uploads],
                            overwrite=False,
                        ),
                        group,
                    )
            except Exception as e:
                error = e
        finally:
            if early is not None:
                early.close()
        dist.agree(error, f"uploading checkpoint files to '{dir}'", group)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return entries


class _EarlyUploads:
    """Uploads staged files while the rest are still being written, on the back end's
    `thread_count` threads. Called on: one rank, for its own files."""

    def __init__(self, storage: Storage, staging: Path, dir: str, threads: int) -> None:
        self.storage, self.staging, self.dir = storage, staging, dir
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="trainckpt-upload")
        self._futures: dict[str, Future[None]] = {}
        self._lock = threading.Lock()

    def submit(self, rel: str) -> None:
        with self._lock:
            if rel not in self._futures:
                target = self.storage.join(self.dir, rel)
                self._futures[rel] = self._pool.submit(
                    self.storage.upload, self.staging / rel, target, overwrite=False
                )

    def finish(self, rels: list[str]) -> None:
        """Upload what was not uploaded yet, wait for every upload; the first error raises."""
        for rel in rels:
            self.submit(rel)
        with self._lock:
            futures = list(self._futures.values())
        for f in futures:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def _prepare_prefix(req: SaveRequest) -> tuple[Claim, bool]:
    """Rank 0: refuse a committed target (unless save_overwrite), claim the step, put an old
    checkpoint of the step aside (`_move_aside`), clear the prefix but for the claim, and start
    renewing the claim. Returns the claim and whether `<dir>-replaced` holds the old folder
    (deleted once the new checkpoint is committed)."""
    storage, dir = req.storage, req.dir
    if is_committed(storage, dir) and not req.overwrite:
        raise _exists(dir)
    claim = claims.acquire(storage, dir, req.claim_lease)
    try:
        files = storage.list_files(dir)
        committed = METADATA_FILE in files  # perhaps by a save that held the claim before
        if committed and not req.overwrite:
            raise _exists(dir)
        aside_kept = _settle_aside(storage, dir, committed)
        if committed:
            log.warning("replacing the committed checkpoint '%s' (save_overwrite)", dir)
        elif ABANDONED_FILE in files:
            log.warning("replacing '%s', abandoned by a rollback to an older step", dir)
        elif set(files) - {CLAIM_FILE} and not aside_kept:
            log.warning("removing '%s': an uncommitted leftover of an interrupted save", dir)
        if (committed or ABANDONED_FILE in files) and not aside_kept:
            _move_aside(storage, dir, files)
        first = [METADATA_FILE, ABANDONED_FILE]  # what makes it a checkpoint (or one undone)
        storage.delete_files(storage.join(dir, rel) for rel in first if rel in files)
        storage.delete_files(
            storage.join(dir, rel) for rel in files if rel not in (CLAIM_FILE, *first)
        )
        replacing = aside_kept or committed or ABANDONED_FILE in files
        if replacing:
            fault_point("replacing")
        claim.start_renewing()
    except BaseException:
        claim.release()
        raise
    return claim, replacing


def _aside(storage: Storage, dir: str) -> str:
    return storage.join(storage.parent(dir), replaced_name(storage.name(dir)))


def _move_aside(storage: Storage, dir: str, files: dict[str, int]) -> None:
    """Object stores: copy the old checkpoint of step `dir` (committed, being overwritten, or
    abandoned by a rollback) to `<dir>-replaced`, server-side, before its objects are deleted:
    the old files then exist whole at every moment until the new checkpoint is committed, as
    with the rename of `_swap_in`. `.abandoned.json` (holding the old commit record) is written
    last and marks the copy complete; the copy never holds a commit record, so no finder takes
    it for a checkpoint. Called on: rank 0, holding the step's claim."""
    aside = _aside(storage, dir)
    records = (METADATA_FILE, ABANDONED_FILE, CLAIM_FILE)
    storage.copy_many(
        [(storage.join(dir, rel), storage.join(aside, rel)) for rel in files if rel not in records]
    )
    fault_point("copying-aside")
    record = METADATA_FILE if METADATA_FILE in files else ABANDONED_FILE
    storage.write_bytes(
        storage.join(aside, ABANDONED_FILE), storage.read_bytes(storage.join(dir, record))
    )


def _settle_aside(storage: Storage, dir: str, committed: bool) -> bool:
    """Object stores: deal with a `<dir>-replaced` an interrupted replacement left; return
    whether it is kept. A complete one (marked by `.abandoned.json`) beside an uncommitted
    `dir` is the only whole copy of the old folder: it stays until this save commits. One
    beside a committed `dir` (the replacement, or the old folder, is whole there), or an
    incomplete one (the old folder was still whole in `dir`), is deleted, marker first.
    Called on: rank 0, holding the step's claim."""
    aside = _aside(storage, dir)
    files = storage.list_files(aside)
    if not files:
        return False
    if ABANDONED_FILE in files and not committed:
        log.warning(
            "'%s' holds the old folder of '%s', moved aside by an interrupted save; it is "
            "kept until this save of the step commits",
            aside,
            dir,
        )
        return True
    _delete_aside(storage, aside, files)
    return False


def _delete_aside(storage: Storage, aside: str, files: dict[str, int] | None = None) -> None:
    """Delete `<dir>-replaced` on an object store, its completion marker first."""
    files = storage.list_files(aside) if files is None else files
    storage.delete_files([storage.join(aside, ABANDONED_FILE)])
    storage.delete_files(storage.join(aside, rel) for rel in files if rel != ABANDONED_FILE)


def _abandon(storage: Storage, dir: str, claim: Claim) -> None:
    """Rank 0, after a failed save: remove what it uploaded and its claim, unless the claim
    was lost (the prefix is another save's now) or the step got committed. Best effort."""
    claim.stop()
    if claim.lost:
        return
    try:
        files = storage.list_files(dir)
        if METADATA_FILE not in files:
            storage.delete_files(storage.join(dir, rel) for rel in files if rel != CLAIM_FILE)
    except CheckpointError as e:
        log.warning("could not remove what the failed save uploaded to '%s': %s", dir, e)
    claim.release()


def _exists(dir: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"'{dir}' is already a committed checkpoint; pass save_overwrite=True to replace it, "
        "or save to another step"
    )


# -- shared steps --------------------------------------------------------------------------------


def _run_write(files: RankFiles, to: WriteTarget) -> tuple[dict[str, FileEntry], Exception | None]:
    """This rank's files, written (`rank_write.py`), or the error that stopped it."""
    try:
        return files.write(to), None
    except Exception as e:  # shared with the other ranks by the caller
        return {}, e


def _write_records(
    req: SaveRequest,
    folder: str,
    parts: list[dict[str, FileEntry]],
    *,
    attempt: str | None = None,
    before_commit: Callable[[], None] | None = None,
) -> None:
    """Rank 0: `.manifest.json` (naming the save `attempt`, if any), a check that every file
    it lists is in `folder` with its size (and nothing else is), `before_commit` (object
    stores: confirm the claim), then `.metadata.json` — the commit."""
    storage = req.storage
    manifest = CheckpointManifest.merge(
        parts, step=req.step, world_size=dist.get_world_size(req.group), attempt=attempt
    )
    fault_point("before-manifest")
    storage.write_bytes(
        storage.join(folder, MANIFEST_FILE),
        manifest.to_json(),
        overwrite=storage.atomic_rename,  # object stores: create-only, like every object
        make_parents=False,  # never into a recreated copy of a folder deleted under the save
    )
    _check_complete(storage, folder, manifest)
    if before_commit is not None:
        before_commit()
    fault_point("before-commit-record")
    storage.write_bytes(
        storage.join(folder, METADATA_FILE),
        CheckpointMetadata(ephemeral=req.ephemeral).to_json(),
        overwrite=req.overwrite or storage.atomic_rename,
        make_parents=False,
    )


def _check_complete(storage: Storage, folder: str, manifest: CheckpointManifest) -> None:
    """Every file `manifest` lists is in `folder` with its size, and no other file is (but
    the records): what the commit record is about to vouch for. Called on: rank 0."""
    listing = storage.list_files(folder)
    problems = [
        f"'{rel}' {'is missing' if rel not in listing else f'has {listing[rel]} bytes'}"
        for rel, entry in manifest.files.items()
        if listing.get(rel) != entry.size
    ]
    problems += [
        f"'{rel}' is not in the manifest"
        for rel in sorted(set(listing) - set(manifest.files))
        if rel not in (MANIFEST_FILE, METADATA_FILE, CLAIM_FILE)
    ]
    if problems:
        raise CorruptCheckpointError(
            f"not committing '{folder}': its files changed during the save ("
            + "; ".join(problems[:5])
            + (f"; {len(problems) - 5} more" if len(problems) > 5 else "")
            + "). Another process wrote or deleted objects there; nothing was committed, "
            "save again"
        )
