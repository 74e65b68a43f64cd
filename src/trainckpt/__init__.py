"""trainckpt: crash-safe checkpointing for PyTorch training."""

__version__ = "0.1.0"

from .checkpointer import Checkpointer  # noqa: E402
from .checkpointing import Checkpointing  # noqa: E402
from .config import CheckpointerConfig  # noqa: E402
from .errors import (  # noqa: E402
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
from .model_states import ModelAndStates  # noqa: E402
from .policy import CheckpointPolicy  # noqa: E402
from .records import CheckpointManifest, CheckpointMetadata  # noqa: E402
from .train_module import ModelAndOptim, ModelWeights, TrainModule  # noqa: E402
from .verify import VerifyReport  # noqa: E402


def __getattr__(name: str) -> object:
    """`OLMoCheckpointerConfig` is imported on first use: it imports OLMo-core (the `olmo`
    extra), which takes seconds and is not needed otherwise."""
    if name == "OLMoCheckpointerConfig":
        from .olmo import OLMoCheckpointerConfig

        return OLMoCheckpointerConfig
    raise AttributeError(f"module 'trainckpt' has no attribute '{name}'")


__all__ = [
    "CheckpointError",
    "CheckpointExistsError",
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
