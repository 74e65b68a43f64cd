"""`trainckpt prune`: which step folders of a save folder to delete, and deleting them safely.

`plan_prune` is pure (folder entries of `format.folder_scan.scan_folder` in, decisions out) so the
rules can be read and tested without a disk; `apply_prune` deletes through
`commit.delete_checkpoint`, which removes the commit record first, so an interrupted prune leaves
uncommitted folders that no finder reports, never a torn checkpoint that looks good.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from trainckpt.core.commit import delete_checkpoint, delete_leftover
from trainckpt.errors import CheckpointNotFoundError, ConcurrentSaveError, ConfigurationError
from trainckpt.format.folder_scan import FolderEntry
from trainckpt.storage import resolve


@dataclass(frozen=True)
class Decision:
    """Keep or delete one step folder, and why."""

    entry: FolderEntry
    delete: bool
    reason: str


@dataclass(frozen=True)
class PrunePlan:
    """Every step folder of a save folder with its decision; `to_delete` is oldest first."""

    folder: str
    decisions: list[Decision]

    @property
    def to_delete(self) -> list[FolderEntry]:
        return [d.entry for d in self.decisions if d.delete]

    @property
    def freed_bytes(self) -> int:
        return sum(e.size for e in self.to_delete)


def plan_prune(
    folder: str, entries: Sequence[FolderEntry], *, keep_last: int, keep_ephemeral: bool
) -> PrunePlan:
    """Decide what `prune` deletes.

    Kept: the newest `keep_last` permanent committed checkpoints; the newest committed
    checkpoint whatever its kind (the run resumes from it); ephemeral ones with
    `keep_ephemeral`; damaged ones, whose commit record or manifest cannot be read (a person
    looks at them first; they never count as the newest).
    Deleted: every other committed checkpoint, and all uncommitted and `-tmp` leftovers.
    Refuses a folder holding no committed checkpoint (most likely a wrong path).
    """
    if keep_last < 1:
        raise ConfigurationError(
            f"--keep-last must be at least 1, got {keep_last}: prune always keeps checkpoints"
        )
    committed = [e for e in entries if e.state == "committed"]
    if not committed:
        what = f"only {len(entries)} uncommitted leftover(s)" if entries else "no step folders"
        raise CheckpointNotFoundError(
            f"'{folder}' holds no committed checkpoint ({what}); refusing to prune it: "
            "check the path (`trainckpt ls FOLDER` shows what is there)"
        )
    newest = max(committed, key=lambda e: e.step)
    permanent = sorted((e for e in committed if e.ephemeral is False), key=lambda e: e.step)
    kept_permanent = {e.path for e in permanent[-keep_last:]}
    decisions = []
    for e in sorted(entries, key=lambda e: (e.step, e.name)):
        decisions.append(_decide(e, newest, kept_permanent, keep_last, keep_ephemeral))
    return PrunePlan(folder=folder, decisions=decisions)


def _decide(
    e: FolderEntry,
    newest: FolderEntry,
    kept_permanent: set[str],
    keep_last: int,
    keep_ephemeral: bool,
) -> Decision:
    if e.state == "tmp":
        return Decision(e, True, "leftover of an interrupted save (-tmp)")
    if e.state == "uncommitted":
        return Decision(e, True, "uncommitted leftover (no commit record)")
    if e.state == "damaged":
        return Decision(e, False, "damaged record: inspect it, then delete it by hand")
    if e.path in kept_permanent:
        return Decision(e, False, f"one of the newest {keep_last} permanent")
    if e is newest:
        return Decision(e, False, "newest committed checkpoint")
    if e.ephemeral:
        if keep_ephemeral:
            return Decision(e, False, "ephemeral (--keep-ephemeral)")
        return Decision(e, True, "ephemeral")
    return Decision(e, True, f"older than the newest {keep_last} permanent")


def apply_prune(
    plan: PrunePlan,
    on_deleted: Callable[[FolderEntry], None],
    on_kept: Callable[[FolderEntry], None] = lambda entry: None,
) -> None:
    """Delete `plan.to_delete`, oldest first, each commit record first. An uncommitted
    leftover on an object store that a save in progress turns out to own (or that got
    committed meanwhile) is kept and passed to `on_kept`; so is a local folder whose step a
    save still running holds the lock of (its `-tmp`, or the checkpoint a `save_overwrite`
    replaces). Called on: one process."""
    storage, _ = resolve(plan.folder)
    for entry in plan.to_delete:
        if entry.state == "committed":
            try:
                delete_checkpoint(storage, entry.path)
            except ConcurrentSaveError:  # a save_overwrite of this step holds its lock
                on_kept(entry)
                continue
        elif not delete_leftover(storage, entry.path):
            on_kept(entry)
            continue
        on_deleted(entry)
