"""trainckpt: crash-safe checkpointing for PyTorch training.

The public names are imported on first use (PEP 562), so `import trainckpt` and the `trainckpt`
command's `--help` do not pay for torch; `from trainckpt import Checkpointer` imports what it needs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from trainckpt.version import __version__

if TYPE_CHECKING:
    from trainckpt.checkpointer import Checkpointer, CheckpointerConfig
    from trainckpt.core.save_report import SaveReport
    from trainckpt.errors import (
        CheckpointError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CheckpointTimeoutError,
        ConcurrentSaveError,
        ConfigurationError,
        CorruptCheckpointError,
        InvalidTrainStateError,
        RankFailedError,
        SharedFolderError,
        StorageError,
        UnsafeCheckpointError,
    )
    from trainckpt.format.records import CheckpointManifest, CheckpointMetadata
    from trainckpt.format.verify import VerifyReport
    from trainckpt.integrations.olmo_core import OLMoCheckpointerConfig  # noqa: F401 (not in __all__: optional)
    from trainckpt.manager import CheckpointManager
    from trainckpt.model_states import ModelAndStates
    from trainckpt.retention.policy import CheckpointPolicy
    from trainckpt.train_module import ModelAndOptim, ModelWeights, TrainModule

    Checkpointing = CheckpointManager

_ERRORS = (
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CheckpointTimeoutError",
    "ConcurrentSaveError",
    "ConfigurationError",
    "CorruptCheckpointError",
    "InvalidTrainStateError",
    "RankFailedError",
    "SharedFolderError",
    "StorageError",
    "UnsafeCheckpointError",
)

_WHERE: dict[str, tuple[str, str]] = {
    "Checkpointer": ("trainckpt.checkpointer", "Checkpointer"),
    "CheckpointerConfig": ("trainckpt.checkpointer", "CheckpointerConfig"),
    "SaveReport": ("trainckpt.core.save_report", "SaveReport"),
    "CheckpointManifest": ("trainckpt.format.records", "CheckpointManifest"),
    "CheckpointMetadata": ("trainckpt.format.records", "CheckpointMetadata"),
    "VerifyReport": ("trainckpt.format.verify", "VerifyReport"),
    "CheckpointManager": ("trainckpt.manager", "CheckpointManager"),
    # the name `CheckpointManager` had before 0.2, kept for existing code
    "Checkpointing": ("trainckpt.manager", "CheckpointManager"),
    "ModelAndStates": ("trainckpt.model_states", "ModelAndStates"),
    "CheckpointPolicy": ("trainckpt.retention.policy", "CheckpointPolicy"),
    "ModelAndOptim": ("trainckpt.train_module", "ModelAndOptim"),
    "ModelWeights": ("trainckpt.train_module", "ModelWeights"),
    "TrainModule": ("trainckpt.train_module", "TrainModule"),
    # imports OLMo-core (the `olmo` extra), which takes seconds; not in __all__
    "OLMoCheckpointerConfig": ("trainckpt.integrations.olmo_core", "OLMoCheckpointerConfig"),
    **{name: ("trainckpt.errors", name) for name in _ERRORS},
}


def __getattr__(name: str) -> object:
    """Import a public name on first use and keep it in the module."""
    try:
        module, attr = _WHERE[name]
    except KeyError:
        raise AttributeError(f"module 'trainckpt' has no attribute '{name}'") from None
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointManager",
    "CheckpointManifest",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "CheckpointPolicy",
    "CheckpointTimeoutError",
    "ConcurrentSaveError",
    "Checkpointer",
    "CheckpointerConfig",
    "Checkpointing",
    "ConfigurationError",
    "CorruptCheckpointError",
    "InvalidTrainStateError",
    "ModelAndOptim",
    "ModelAndStates",
    "ModelWeights",
    "RankFailedError",
    "SaveReport",
    "SharedFolderError",
    "StorageError",
    "TrainModule",
    "UnsafeCheckpointError",
    "VerifyReport",
    "__version__",
]
