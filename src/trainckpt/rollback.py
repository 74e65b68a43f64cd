"""`RollbackBookkeeping`: a `Checkpointer` remembers the checkpoint it loaded last, so a run that
resumes from an older step abandons its save folder's newer checkpoints (docs/rollback.md).
Called on: all ranks."""

from __future__ import annotations

import os

from trainckpt.config import CheckpointerSettings
from trainckpt.core import dist
from trainckpt.format import folder as save_folder
from trainckpt.storage import Storage, StorageOptions, resolve


class RollbackBookkeeping:
    """Rollback at resume (a mix-in: the checkpointer sets these attributes)."""

    config: CheckpointerSettings
    process_group: dist.ProcessGroup | None
    _storage_options: StorageOptions
    _loaded: tuple[Storage, str, int] | None
    """(storage, folder, step) of the last checkpoint loaded, until the next save."""

    def resume_into(self, save_folder: str | os.PathLike[str]) -> list[int]:
        """Say that the run trains on from the checkpoint loaded last and saves into
        `save_folder`. When that checkpoint is a step of `save_folder` and newer ones are
        committed there, they are abandoned now (docs/rollback.md) instead of at the first
        save, so a crash before that save cannot resume from them. A load for evaluation must
        not call this; loading another folder's checkpoint abandons nothing. Returns the
        abandoned steps. Called on: all ranks."""
        storage, folder = resolve(save_folder, self._storage_options)
        return self._abandon_after_rollback(storage, folder)

    def _abandon_after_rollback(self, storage: Storage, folder: str) -> list[int]:
        """At `resume_into`, or else before the first save after a load: when the run saves
        into the folder the loaded checkpoint came from, it resumed there, and that folder's
        checkpoints newer than the loaded one are abandoned (docs/design.md §11,
        `folder.abandon_newer`), so no finder reports them again and this run's saves of those
        steps replace them. (OLMo-core's Trainer loads and saves through this class;
        `CheckpointManager` abandons them already at resume.) Called on: all ranks."""
        loaded, self._loaded = self._loaded, None
        if loaded is None or type(loaded[0]) is not type(storage) or folder != loaded[1]:
            return []
        step = loaded[2]
        abandoned = dist.run_on_rank0(
            lambda: save_folder.abandon_newer(
                storage, folder, step, refuse=self.config.on_rollback == "refuse"
            ),
            f"abandoning the checkpoints newer than step {step} in '{folder}'",
            self.process_group,
        )
        return [s for s, _ in abandoned]
