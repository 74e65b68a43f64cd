"""The steps both commit protocols share (docs/design.md §4): the save request, the wait for a
lagging shared filesystem, this rank's write, and rank 0's records: `.manifest.json`, the check
that every file it lists is there with its size, then `.metadata.json` (the commit).

Split from `commit.py` so the filesystem protocol (`commit_rename.py`) and the object-store
protocol (`commit_object_store.py`) import them without importing each other. Called on: all
ranks (`run_write`, `wait_for`), rank 0 (the records).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from trainckpt.core import claim as claims
from trainckpt.core import dist
from trainckpt.core.rank_write import RankFiles, WriteTarget
from trainckpt.errors import CheckpointExistsError, CorruptCheckpointError
from trainckpt.format.layout import CLAIM_FILE, MANIFEST_FILE, METADATA_FILE
from trainckpt.format.records import CheckpointManifest, CheckpointMetadata
from trainckpt.storage import Storage
from trainckpt.storage.checksums import FileEntry
from trainckpt.testing.faults import fault_point


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


def exists_error(dir: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"'{dir}' is already a committed checkpoint; pass save_overwrite=True to replace it, "
        "or save to another step"
    )


def run_write(files: RankFiles, to: WriteTarget) -> tuple[dict[str, FileEntry], Exception | None]:
    """This rank's files, written (`rank_write.py`), or the error that stopped it."""
    try:
        return files.write(to), None
    except Exception as e:  # shared with the other ranks by the caller
        return {}, e


def write_records(
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
    check_complete(storage, folder, manifest)
    if before_commit is not None:
        before_commit()
    fault_point("before-commit-record")
    storage.write_bytes(
        storage.join(folder, METADATA_FILE),
        CheckpointMetadata(ephemeral=req.ephemeral).to_json(),
        overwrite=req.overwrite or storage.atomic_rename,
        make_parents=False,
    )


def check_complete(storage: Storage, folder: str, manifest: CheckpointManifest) -> None:
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
