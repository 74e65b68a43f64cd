"""The one model of a save folder: its step folders, what each holds, and deleting one.

A save folder holds step folders named `stepN` (trainckpt, OLMo-core) or `step-N` (torchtitan),
and the `-tmp` working folders of saves in progress or interrupted (names parsed by
`layout.parse_step_folder` only). A step folder is a checkpoint only when its commit record
(`.metadata.json`) exists. One whose commit record or manifest is there but cannot be read is
`damaged`: retention and `prune` keep it for a person to look at, never counting it as the newest.
The finders read the commit record only: one that cannot be read is skipped with a warning, a
damaged manifest fails verification (so `load` refuses it, `find_latest_good` skips it). A
`step-N` folder without a commit record is a checkpoint torchtitan wrote: neither ours to list nor
to delete.

Everything that reads a save folder goes through here: the finders, `Checkpointer`'s finding
classmethods, retention, `find_latest_good` (`verify.newest_good`), and the full scan of
`trainckpt ls` and `prune` (`folder_scan.py`).
Records are read through `records.py`'s size-bounded readers, each once per scan. Pure reads
through the `Storage` interface (local paths and URLs alike), no process group; called on any
one process.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Literal

from trainckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
)
from trainckpt.format import layout
from trainckpt.format.records import CheckpointManifest, CheckpointMetadata, read_manifest
from trainckpt.format.records import read_metadata as read_commit_record
from trainckpt.storage import Storage

log = logging.getLogger(__name__)

State = Literal["committed", "damaged", "uncommitted", "tmp"]
"""`damaged`: a commit record is there, but it or the manifest cannot be read."""


# -- step folders by name ------------------------------------------------------------------------


@dataclass(frozen=True)
class StepFolder:
    """A step folder directly under a save folder, as its name tells (no request made)."""

    name: str
    path: str
    step: int
    tmp: bool
    """A `-tmp` working folder of a save (running, or interrupted)."""

    def ours(self, committed: bool, abandoned: bool = False) -> bool:
        """False for a `step-N` folder without a commit record that no rollback abandoned: a
        checkpoint torchtitan wrote (or is writing), never a leftover of ours to list or
        delete."""
        return committed or abandoned or self.tmp or not layout.is_torchtitan_name(self.name)


def step_folders(storage: Storage, path: str, *, tmp: bool = False) -> list[StepFolder]:
    """Step folders directly under `path` (with `tmp`, the `-tmp` working folders too), by step
    then name, from one listing. A missing folder raises `FileNotFoundError`; a back end that
    cannot list (HTTP) raises `ConfigurationError`."""
    if not storage.supports_listing:
        raise ConfigurationError(
            f"'{path}' cannot be listed (that storage has no listing); "
            "pass the URL of one checkpoint instead of a folder of checkpoints"
        )
    found = []
    for name in storage.list_dir(path).dirs:
        parsed = layout.parse_step_folder(name)
        if parsed is not None and (tmp or not parsed[1]):
            found.append(StepFolder(name, storage.join(path, name), *parsed))
    return sorted(found, key=lambda f: (f.step, f.name))


# -- records ---------------------------------------------------------------------------------------


def is_committed(storage: Storage, ckpt: str) -> bool:
    """True when step folder `ckpt` has a commit record (one existence check; the record is
    not read)."""
    return storage.exists(storage.join(ckpt, layout.METADATA_FILE))


def is_checkpoint(storage: Storage, path: str) -> bool:
    """True for a committed checkpoint or a bare DCP folder (model weights only)."""
    return is_committed(storage, path) or storage.exists(
        storage.join(path, layout.DCP_METADATA_FILE)
    )


def commit_record(storage: Storage, ckpt: str) -> CheckpointMetadata | None:
    """The commit record of step folder `ckpt`; None when it has none (not committed) or when
    the record is damaged, which is logged as a warning naming the file."""
    try:
        return read_commit_record(storage, ckpt)
    except FileNotFoundError:
        return None
    except CorruptCheckpointError as e:
        log.warning("skipping '%s': %s", ckpt, e)
        return None


def read_metadata(storage: Storage, path: str) -> CheckpointMetadata:
    """The commit record of the checkpoint at `path`; `CheckpointNotFoundError` without one."""
    try:
        return read_commit_record(storage, path)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"'{path}' is not a committed checkpoint: "
            f"'{storage.join(path, layout.METADATA_FILE)}' does not exist"
        ) from e


@dataclass(frozen=True)
class Records:
    """A step folder's commit record and manifest, each read once. A record that is absent is
    None; one that is there but cannot be read is None too, and `problems` says why."""

    metadata: CheckpointMetadata | None = None
    manifest: CheckpointManifest | None = None
    problems: tuple[str, ...] = ()


def read_records(storage: Storage, ckpt: str, listed: Collection[str] | None = None) -> Records:
    """The records of step folder `ckpt`. `listed`: the files a listing of the folder showed;
    a record not among them is absent without a request, and one among them that cannot be
    read (gone since, damaged, hostile, too large) is a problem. Without `listed` the caller
    has seen the commit record (`is_committed`), so both are read and only a missing manifest
    is fine (OLMo-core writes none)."""
    metadata: CheckpointMetadata | None = None
    manifest: CheckpointManifest | None = None
    problems: list[str] = []
    if listed is None or layout.METADATA_FILE in listed:
        try:
            metadata = read_commit_record(storage, ckpt)
        except (CheckpointError, OSError) as e:
            problems.append(f"unreadable commit record: {e}")
    if listed is None or layout.MANIFEST_FILE in listed:
        try:
            manifest = read_manifest(storage, ckpt)
        except FileNotFoundError as e:
            if listed is not None:
                problems.append(f"unreadable manifest: {e}")
        except (CheckpointError, OSError) as e:
            problems.append(f"unreadable manifest: {e}")
    return Records(metadata, manifest, tuple(problems))


def state_of(
    folder: StepFolder, committed: bool, records: Records, abandoned: bool = False
) -> State | None:
    """The state of a step folder whose commit record was seen (`committed`) or not, with the
    records read of it; None when it is not ours (`StepFolder.ours`). An abandoned folder
    (`abandon_newer`) is `uncommitted`. The one rule the finders, retention, `prune` and `ls`
    share."""
    if folder.tmp:
        return "tmp"
    if not committed:
        return "uncommitted" if folder.ours(committed, abandoned) else None
    if records.problems or records.metadata is None:
        return "damaged"
    return "committed"


def step_states(
    storage: Storage,
    path: str,
    read: Callable[[Storage, str], Records] = read_records,
) -> list[tuple[StepFolder, State, Records]]:
    """Every step folder of ours under `path` (`-tmp` ones too) with its state: one listing,
    one commit-record check per step folder but the `-tmp` ones, and `read(storage, ckpt)` of
    each committed one (retention passes a cache). A missing folder holds none."""
    try:
        folders = step_folders(storage, path, tmp=True)
    except FileNotFoundError:
        return []
    out = []
    for f in folders:
        committed = not f.tmp and is_committed(storage, f.path)
        records = read(storage, f.path) if committed else Records()
        abandoned = not f.ours(committed) and is_abandoned(storage, f.path)
        state = state_of(f, committed, records, abandoned)
        if state is not None:
            out.append((f, state, records))
    return out


# -- finders ---------------------------------------------------------------------------------------


def find_checkpoints(
    storage: Storage, path: str, ephemeral: bool | None = None
) -> Iterator[tuple[int, str]]:
    """Committed checkpoints directly under `path`, ascending by step: one listing, then one
    read of each step folder's commit record (a missing one means not committed, a damaged
    one is skipped with a warning)."""
    for f in step_folders(storage, path):
        record = commit_record(storage, f.path)
        if record is not None and ephemeral in (None, record.ephemeral):
            yield f.step, f.path


def latest_checkpoint(storage: Storage, path: str) -> str:
    """The committed checkpoint with the highest step under `path`, probing from the newest
    down (one read per step folder probed); `CheckpointNotFoundError` when there is none."""
    for f in reversed(step_folders(storage, path)):
        if commit_record(storage, f.path) is not None:
            return f.path
    raise CheckpointNotFoundError(
        f"no committed checkpoint in '{path}' (looked for step folders holding "
        f"{layout.METADATA_FILE}); start from scratch or point to another folder"
    )


def contains_checkpoint(storage: Storage, path: str) -> bool:
    """True when `path` is a checkpoint (or bare DCP folder) or holds at least one."""
    if is_checkpoint(storage, path):
        return True
    try:
        latest_checkpoint(storage, path)
    except FileNotFoundError:
        return False
    return True


# -- one checkpoint --------------------------------------------------------------------------------


def saved_world_size(storage: Storage, path: str) -> int | None:
    """The world size recorded in a checkpoint's manifest; None without one (OLMo-core's)."""
    try:
        return read_manifest(storage, path).world_size
    except FileNotFoundError:
        return None


def checkpoint_size(storage: Storage, ckpt: str) -> int | None:
    """Total bytes of the files a checkpoint's manifest lists; None (unknown) without a
    readable manifest."""
    try:
        manifest = read_manifest(storage, ckpt)
    except (CheckpointError, OSError):
        return None
    return sum(e.size for e in manifest.files.values())


def dcp_folder(storage: Storage, path: str) -> str:
    """The DCP folder of a checkpoint: `model_and_optim/`, or the folder itself when bare."""
    nested = storage.join(path, layout.MODEL_DIR)
    if storage.exists(storage.join(nested, layout.DCP_METADATA_FILE)):
        return nested
    if storage.exists(storage.join(path, layout.DCP_METADATA_FILE)):
        return path
    if is_committed(storage, path):
        raise CorruptCheckpointError(
            f"'{path}' is committed but '{nested}/{layout.DCP_METADATA_FILE}' is missing; the "
            "checkpoint is damaged: load an older one or restore it from a copy"
        )
    require_folder(storage, path)  # a clearer error for a missing path or a file
    raise CheckpointNotFoundError(
        f"'{path}' is not a checkpoint (no {layout.METADATA_FILE}, no "
        f"{layout.MODEL_DIR}/{layout.DCP_METADATA_FILE}); check the path, or use "
        "Checkpointer.latest_checkpoint(folder) to find one"
    )


def require_folder(storage: Storage, path: str) -> None:
    """Raise a clear `CheckpointNotFoundError` when `path` is no folder at all."""
    if storage.exists(path):
        raise CheckpointNotFoundError(
            f"'{path}' is a file, not a checkpoint folder: pass a step folder such as "
            f"'{storage.parent(path)}/step1000'"
        )
    try:
        listing = storage.list_dir(path) if storage.supports_listing else None
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"'{path}' does not exist: check the path, or use "
            "Checkpointer.latest_checkpoint(folder) to find a checkpoint"
        ) from e
    if listing is not None and not listing.dirs and not listing.files:
        raise CheckpointNotFoundError(
            f"'{path}' does not exist or is empty: check the path, or use "
            "Checkpointer.latest_checkpoint(folder) to find a checkpoint"
        )


# -- rolling back (docs/design.md §11) ------------------------------------------------------


def abandon_newer(
    storage: Storage, path: str, step: int, *, refuse: bool = False
) -> list[tuple[int, str]]:
    """A run resumed from `step`: abandon every checkpoint under `path` of a newer step, so no
    finder reports one again (ours, OLMo-core's, the torchtitan integration's). Returns (step,
    path) of those abandoned now, ascending; a missing folder holds none. With `refuse`
    (`on_rollback="refuse"`), raise `ConfigurationError` naming them instead, changing nothing.

    Each loses its commit record first (one atomic deletion, as a deletion starts), then gets
    `.abandoned.json` holding that record (renaming it back undoes the abandonment); its files
    stay until the new run saves that step
    (`commit.py` replaces the folder only once the new checkpoint is complete) or retention
    passes it. Folders torchtitan's own manager wrote (`step-N`, no commit record) are marked
    only. Called on: one process (rank 0).
    """
    try:
        folders = step_folders(storage, path)
    except FileNotFoundError:
        return []
    newer = []
    for f in folders:
        if f.step <= step:
            continue
        files = storage.list_files(f.path)
        committed = layout.METADATA_FILE in files
        theirs = not f.ours(committed) and layout.ABANDONED_FILE not in files
        if committed or theirs:
            newer.append((f, committed))
    if refuse and newer:
        raise ConfigurationError(
            f"'{path}': this run resumed from step {step}, but it holds newer checkpoints "
            f"(steps {[f.step for f, _ in newer]}) and on_rollback='refuse' keeps them. Resume "
            "from the newest, move those steps away, or set on_rollback='replace' "
            "(CheckpointerConfig) to abandon them so that this run's saves replace them"
        )
    abandoned = []
    for f, committed in newer:
        _abandon(storage, f.path, committed)
        abandoned.append((f.step, f.path))
    if abandoned:
        log.warning(
            "rolled back: the run resumed from step %s of '%s', so the newer checkpoints of "
            "steps %s are abandoned (no finder reports them again; each is replaced when the "
            "run saves that step). Their files are kept until then: to go back to one, rename "
            "its %s to %s (one torchtitan wrote: delete it)",
            step,
            path,
            [s for s, _ in abandoned],
            layout.ABANDONED_FILE,
            layout.METADATA_FILE,
        )
    return abandoned


def _abandon(storage: Storage, ckpt: str, committed: bool) -> None:
    """Remove `ckpt`'s commit record, then write it again as `.abandoned.json` (`{}` for a
    folder torchtitan wrote, which has none); a damaged record is not kept."""
    record = b"{}"
    if committed:
        try:
            record = read_commit_record(storage, ckpt).to_json()
        except (OSError, CheckpointError) as e:
            log.warning("'%s': its commit record is unreadable (%s); not kept", ckpt, e)
        storage.delete_files([storage.join(ckpt, layout.METADATA_FILE)])
    storage.write_bytes(storage.join(ckpt, layout.ABANDONED_FILE), record, make_parents=False)


def is_abandoned(storage: Storage, ckpt: str) -> bool:
    """True when step folder `ckpt` was abandoned by a rollback (`abandon_newer`)."""
    return storage.exists(storage.join(ckpt, layout.ABANDONED_FILE))


# -- deleting --------------------------------------------------------------------------------------


def delete_step_folder(storage: Storage, path: str) -> None:
    """Delete a step folder, its commit record first, so a crash midway (`during-delete`)
    leaves an uncommitted folder no finder reports, never a torn checkpoint. A missing folder
    is ignored; on a filesystem a symbolic link loses only the link. No lock is taken here:
    `core/commit.py` holds the step's lock around it. Called on: one process."""
    storage.delete_tree(path, first=[layout.METADATA_FILE])
