"""`CheckpointFinders`: the finding and inspection methods of a `Checkpointer` (committed
checkpoints of a folder, the newest good one, verify, delete, the commit record); they delegate
to `format.folder` and `format.verify`. Called on: any one process, unless a method says so."""

from __future__ import annotations

import os
from collections.abc import Iterator

from trainckpt.config import CheckpointerSettings
from trainckpt.core import dist
from trainckpt.core.commit import delete_checkpoint
from trainckpt.format import folder as save_folder
from trainckpt.format import layout
from trainckpt.format.records import CheckpointMetadata
from trainckpt.format.verify import Progress, VerifyReport, newest_good, verify_checkpoint
from trainckpt.storage import StorageOptions, resolve


class CheckpointFinders:
    """Finding checkpoints (a mix-in: the checkpointer sets these attributes)."""

    config: CheckpointerSettings
    process_group: dist.ProcessGroup | None
    _storage_options: StorageOptions

    @classmethod
    def checkpoint_dirname(cls, step: int) -> str:
        return layout.checkpoint_dirname(step)

    @classmethod
    def dir_is_checkpoint(cls, dir: str | os.PathLike[str]) -> bool:
        """True for a committed checkpoint or a bare DCP folder (model weights only)."""
        return save_folder.is_checkpoint(*resolve(dir))

    @classmethod
    def find_checkpoints(
        cls, dir: str | os.PathLike[str], ephemeral: bool | None = None
    ) -> Iterator[tuple[int, str]]:
        """Committed checkpoints directly under `dir`, as (step, path), ascending by step.

        One listing of `dir`, then one request per step folder: an existence check of its
        commit record, or, with the `ephemeral` filter, a read of it (a missing one means not
        committed). `-tmp` folders and folders without a commit record are skipped.
        """
        yield from save_folder.find_checkpoints(*resolve(dir), ephemeral)

    @classmethod
    def contains_checkpoint(cls, dir: str | os.PathLike[str]) -> bool:
        """True when `dir` is a checkpoint or holds at least one."""
        return save_folder.contains_checkpoint(*resolve(dir))

    @classmethod
    def latest_checkpoint(cls, dir: str | os.PathLike[str]) -> str:
        """Path of the committed checkpoint with the highest step under `dir`.

        Probes step folders from the newest down and stops at the first committed one.
        Raises `CheckpointNotFoundError` (a `FileNotFoundError`) when there is none.
        """
        return save_folder.latest_checkpoint(*resolve(dir))

    @classmethod
    def delete(cls, dir: str | os.PathLike[str]) -> None:
        """Delete a checkpoint folder (committed or not, or a `-tmp` working folder): the
        commit record first, so a crash midway leaves an uncommitted folder that no finder
        reports, never a torn checkpoint. A missing folder is ignored; a symbolic link loses
        only the link. On a filesystem, the folders of a save still running are refused with
        `ConcurrentSaveError` (those of a crashed save are deleted). Called on: one rank."""
        delete_checkpoint(*resolve(dir))

    @classmethod
    def verify(
        cls, dir: str | os.PathLike[str], *, deep: bool = False, progress: Progress | None = None
    ) -> VerifyReport:
        """Check a checkpoint's files against its manifest: missing, resized or unexpected
        files and escaping manifest entries; with `deep`, the CRC32C of every byte. `progress`
        receives byte counts as they are checked. A checkpoint without a manifest (OLMo-core's)
        is reported ok but `unverifiable`. Raises `CheckpointNotFoundError` for a path that is
        no folder. Called on: any one process."""
        return verify_checkpoint(*resolve(dir), deep=deep, progress=progress)

    def find_latest_good(self, dir: str | os.PathLike[str]) -> str | None:
        """The newest committed checkpoint under `dir` that passes verification (sizes, or
        every CRC32C with `verify_on_load="full"`), or None when there is none (or no `dir`).

        Rank 0 checks from the newest down; each one that fails is skipped with a warning
        naming it and the reason. Every rank gets rank 0's answer, so all load the same one.
        Called on: all ranks.
        """
        deep = self.config.verify_on_load == "full"
        return dist.run_on_rank0(
            lambda: newest_good(*resolve(dir, self._storage_options), deep=deep),
            f"finding the newest good checkpoint in '{dir}'",
            self.process_group,
        )

    @classmethod
    def read_metadata(cls, dir: str | os.PathLike[str]) -> CheckpointMetadata:
        """The commit record of a checkpoint."""
        return save_folder.read_metadata(*resolve(dir))
