"""The commit protocol on object stores (docs/design.md §4): rank 0 claims the step
(`claim.py`) and clears the prefix, an old checkpoint of the step copied aside first; every rank
writes its files into a staging folder and uploads them create-only; rank 0 writes the records
while it still holds the claim.

Split from `commit.py`, which picks this protocol when the back end cannot rename. Called on:
all ranks (`save_to_object_store`), rank 0 inside (prepare, commit, clean-up).
"""

from __future__ import annotations

import logging
import shutil
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from trainckpt.core import claim as claims
from trainckpt.core import dist
from trainckpt.core.claim import Claim
from trainckpt.core.commit_steps import SaveRequest, exists_error, run_write, write_records
from trainckpt.core.incremental import Reuse
from trainckpt.core.rank_write import RankFiles, WriteTarget
from trainckpt.core.upload_turns import run_in_turns
from trainckpt.errors import CheckpointError
from trainckpt.format.folder import is_committed
from trainckpt.format.layout import ABANDONED_FILE, CLAIM_FILE, METADATA_FILE, replaced_name
from trainckpt.storage import Storage
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.local import writing
from trainckpt.testing.faults import fault_point

log = logging.getLogger(__name__)


def save_to_object_store(req: SaveRequest, files: RankFiles) -> str:
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
            write_records(req, dir, parts, attempt=claim.attempt, before_commit=claim.confirm)
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
    """Steps 2-3 of `save_to_object_store`: every rank writes its files into a staging folder
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
            entries, error = run_write(files, to)
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
        raise exists_error(dir)
    claim = claims.acquire(storage, dir, req.claim_lease)
    try:
        files = storage.list_files(dir)
        committed = METADATA_FILE in files  # perhaps by a save that held the claim before
        if committed and not req.overwrite:
            raise exists_error(dir)
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
    abandoned by a rollback) to `<dir>-replaced`, server-side, before its objects are
    deleted: the old files then exist whole at every moment until the new checkpoint is
    committed, as with the rename of `commit_rename._swap_in`. `.abandoned.json` (holding
    the old commit record) is written last and marks the copy complete; the copy never holds
    a commit record, so no finder takes it for a checkpoint. Called on: rank 0, holding the
    step's claim."""
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
