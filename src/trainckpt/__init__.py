"""trainckpt: crash-safe checkpointing for PyTorch training."""

from trainckpt.checkpointer import Checkpointer
from trainckpt.config import CheckpointerConfig
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
from trainckpt.manager import CheckpointManager
from trainckpt.model_states import ModelAndStates
from trainckpt.retention.policy import CheckpointPolicy
from trainckpt.train_module import ModelAndOptim, ModelWeights, TrainModule
from trainckpt.version import __version__

Checkpointing = CheckpointManager
"""The name `CheckpointManager` had before 0.2, kept for existing code."""


def __getattr__(name: str) -> object:
    """`OLMoCheckpointerConfig` is imported on first use: it imports OLMo-core (the `olmo`
    extra), which takes seconds and is not needed otherwise."""
    if name == "OLMoCheckpointerConfig":
        from trainckpt.olmo import OLMoCheckpointerConfig

        return OLMoCheckpointerConfig
    raise AttributeError(f"module 'trainckpt' has no attribute '{name}'")


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
    "SharedFolderError",
    "StorageError",
    "TrainModule",
    "UnsafeCheckpointError",
    "VerifyReport",
    "__version__",
]
