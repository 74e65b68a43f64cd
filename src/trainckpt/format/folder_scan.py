"""The full scan of a save folder, for `trainckpt ls` and `prune`: one `FolderEntry` per step
folder of ours (committed, damaged, uncommitted, `-tmp`), with its size, file count, manifest
facts and notes.

Split from `folder.py`, the one model of a save folder, whose step folders, states and records
it reads; the finders do not need this view. Pure reads through the `Storage` interface; called
on any one process (the CLI, or retention's `prune`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainckpt.errors import CheckpointNotFoundError
from trainckpt.format import layout
from trainckpt.format.folder import State, StepFolder, read_records, state_of, step_folders
from trainckpt.storage import Storage


@dataclass(frozen=True)
class FolderEntry:
    """One step folder of a save folder, as `trainckpt ls` shows it and `prune` decides on."""

    name: str
    path: str
    step: int
    state: State
    ephemeral: bool | None
    """From the commit record; None when not committed or the record cannot be read."""
    size: int
    """Bytes of every file the folder holds now (listed), records included."""
    files: int
    created_at: str | None
    """From the manifest (UTC ISO-8601); None without one."""
    world_size: int | None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "step": self.step,
            "state": self.state,
            "ephemeral": self.ephemeral,
            "size": self.size,
            "files": self.files,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "note": self.note,
        }


def scan_folder(storage: Storage, path: str) -> list[FolderEntry]:
    """Every step folder of ours under `path` (committed or not, `-tmp` ones too), by step then
    name. One listing of the folder, one listing per step folder, and a read of each commit
    record and manifest there is. A missing folder raises `FileNotFoundError`."""
    entries = []
    for f in step_folders(storage, path, tmp=True):
        try:
            entry = _describe(storage, f)
        except CheckpointNotFoundError:  # gone since the listing (a save renamed its -tmp)
            continue
        if entry is not None:
            entries.append(entry)
    return entries


def _describe(storage: Storage, folder: StepFolder) -> FolderEntry | None:
    files = storage.list_files(folder.path)
    committed = layout.METADATA_FILE in files
    abandoned = layout.ABANDONED_FILE in files
    if not folder.ours(committed, abandoned):
        return None
    records = read_records(storage, folder.path, listed=files)
    state = state_of(folder, committed, records, abandoned)
    assert state is not None
    notes = list(records.problems)
    if abandoned and folder.tmp:
        notes.append("the old folder of the step, set aside by a save that replaces it")
    elif abandoned and not committed:
        notes.append("abandoned: a run resumed from an older step; its next save replaces it")
    if committed and layout.MANIFEST_FILE not in files:
        notes.append("no manifest (unverifiable)")
    if layout.CLAIM_FILE in files and not committed:
        notes.append("claimed: a save in progress, or a crashed one the next save takes over")
    manifest = records.manifest
    ranks = sum(1 for rel in files if layout.parse_trainer_state_file(rel) is not None)
    return FolderEntry(
        name=folder.name,
        path=folder.path,
        step=folder.step,
        state=state,
        ephemeral=records.metadata.ephemeral if records.metadata else None,
        size=sum(files.values()),
        files=len(files),
        created_at=manifest.created_at if manifest else None,
        world_size=manifest.world_size if manifest else ranks or None,
        note="; ".join(notes),
    )
