"""Hugging Face safetensors for the torchtitan manager: the final save (`last_save_in_hf`) and
the initial load (`initial_load_in_hf`), through torchtitan's state-dict adapter for the key
names."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import layout
from ..errors import ConfigurationError
from ..storage import Storage
from ..torchtitan_layout import HF_INDEX_FILE

if TYPE_CHECKING:
    from .torchtitan import CheckpointManager


def is_hf_checkpoint(storage: Storage, path: str) -> bool:
    """True for a folder of safetensors with an index and no DCP metadata."""
    if storage.exists(storage.join(path, layout.DCP_METADATA_FILE)) or storage.exists(
        storage.join(path, layout.MODEL_DIR, layout.DCP_METADATA_FILE)
    ):
        return False
    return storage.exists(storage.join(path, HF_INDEX_FILE))


def _unsupported(path: str) -> ConfigurationError:
    return ConfigurationError(
        f"'{path}': Hugging Face safetensors are not supported by trainckpt's torchtitan "
        "manager yet; set last_save_in_hf and initial_load_in_hf to false, or use torchtitan's "
        "own manager for them"
    )


def save_hf(manager: CheckpointManager, step: int) -> str:
    """Final save in Hugging Face safetensors (not yet supported)."""
    raise _unsupported(manager.folder)


def load_hf(manager: CheckpointManager, path: str) -> None:
    """Load of Hugging Face safetensors into the model (not yet supported)."""
    raise _unsupported(path)
