"""Rolling back through an OLMo-core Trainer, at load time: `RollbackOnLoadCallback`.

Without it, trainckpt's `Checkpointer` abandons the checkpoints newer than the one a Trainer
loaded from its own save folder at the first save after the load (docs/rollback.md): a crash
before that save would resume from the abandoned newest step. With it, they are abandoned as
soon as the Trainer has loaded (`Checkpointer.resume_into`). A Trainer loads to train on, so
this is safe; a checkpoint loaded from another folder (`load_path`) abandons nothing.

    callbacks={"checkpointer": CheckpointerCallback(...),
               "rollback": RollbackOnLoadCallback()}

Needs the `olmo` extra.
"""

from __future__ import annotations

import logging

from olmo_core.aliases import PathOrStr
from olmo_core.train.callbacks import Callback

log = logging.getLogger(__name__)


class RollbackOnLoadCallback(Callback):
    """Abandons, right after a load, the checkpoints of the save folder newer than the one
    loaded. Called on: all ranks (OLMo-core calls `post_checkpoint_loaded` on every rank)."""

    def post_checkpoint_loaded(self, path: PathOrStr) -> None:
        resume_into = getattr(self.trainer.checkpointer, "resume_into", None)
        if resume_into is None:  # OLMo-core's own checkpointer: it knows no rollback
            log.warning(
                "RollbackOnLoadCallback does nothing with OLMo-core's own Checkpointer; "
                "use trainckpt's (OLMoCheckpointerConfig)"
            )
            return
        resume_into(self.trainer.save_folder)
