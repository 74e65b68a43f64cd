"""The `CheckpointError` family: every failure the library raises on purpose.

Each message names the path involved and what to do about it. Subclasses also derive from the
matching built-in (`FileNotFoundError`, `FileExistsError`, `TimeoutError`) so callers that catch
those keep working.
"""

from __future__ import annotations

from typing import Any


class CheckpointError(Exception):
    """Root of every error trainckpt raises on purpose."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint, folder or file that was asked for does not exist."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """The target of a save is already a committed checkpoint (and `save_overwrite` is off)."""


class ConcurrentSaveError(CheckpointExistsError):
    """Another save (or a deletion) of the same step is in progress, or took the step over."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest, or a record cannot be parsed."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint holds something that would run code or escape its folder when loaded."""


class InvalidTrainStateError(CheckpointError, TypeError):
    """Trainer state holds objects that cannot be loaded back with `weights_only=True`."""


class StorageError(CheckpointError):
    """A storage back end failed (unreachable bucket, permission, exhausted retries)."""


class SharedFolderError(CheckpointError):
    """Ranks that must share a save folder do not see the same files."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """Something the save or load waited for did not happen in time."""


class RankFailedError(CheckpointError):
    """Another rank failed during a collective save or load; this rank stops too."""


class ConfigurationError(CheckpointError, ValueError):
    """A Checkpointer was set up or called in a way that cannot work."""


class UnknownSettingError(ConfigurationError, AttributeError):
    """A `Checkpointer` attribute that does not exist was read or written (a misspelt setting)."""


def settings_error(error: Any, where: str, what: str) -> ConfigurationError:
    """One `ConfigurationError` naming every field a pydantic `ValidationError` complains of."""
    problems = "; ".join(
        f"{'.'.join(str(x) for x in err['loc']) or '(root)'}: {err['msg']}"
        for err in error.errors()
    )
    return ConfigurationError(f"{where}: invalid {what}: {problems}")
