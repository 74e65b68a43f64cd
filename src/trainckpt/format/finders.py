"""Finding checkpoints and their parts in storage: step folders in one listing, commit records,
the DCP folder and the saved world size. Pure reads through the storage interface; no process
group (the classmethods of `Checkpointer` call these).

A step folder counts as a checkpoint only when its commit record exists and parses: one whose
record is damaged or hostile is skipped with a warning naming it, so a resume falls back to the
newest checkpoint that is intact.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from trainckpt.core.commit import is_committed
from trainckpt.errors import CheckpointNotFoundError, ConfigurationError, CorruptCheckpointError
from trainckpt.format import layout, records
from trainckpt.format.records import CheckpointMetadata
from trainckpt.format.verify import require_folder
from trainckpt.storage import Storage

log = logging.getLogger(__name__)


def step_folders(storage: Storage, path: str) -> list[tuple[int, str]]:
    """(step, path) of every `step{N}` folder directly under `path`, ascending, in one listing."""
    if not storage.supports_listing:
        raise ConfigurationError(
            f"'{path}' cannot be listed (that storage has no listing); "
            "pass the URL of one checkpoint instead of a folder of checkpoints"
        )
    listing = storage.list_dir(path)
    steps = [(s, name) for name in listing.dirs if (s := layout.parse_step(name)) is not None]
    return [(s, storage.join(path, name)) for s, name in sorted(steps)]


def find_checkpoints(
    storage: Storage, path: str, ephemeral: bool | None = None
) -> Iterator[tuple[int, str]]:
    """Committed checkpoints directly under `path`, ascending by step: one listing, then one
    read of each step folder's commit record (a missing one means not committed, a damaged
    one is skipped with a warning)."""
    for step, ckpt in step_folders(storage, path):
        record = commit_record(storage, ckpt)
        if record is not None and ephemeral in (None, record.ephemeral):
            yield step, ckpt


def latest_checkpoint(storage: Storage, path: str) -> str:
    """The committed checkpoint with the highest step under `path`, probing from the newest
    down (one read per step folder probed); `CheckpointNotFoundError` when there is none."""
    for _step, ckpt in reversed(step_folders(storage, path)):
        if commit_record(storage, ckpt) is not None:
            return ckpt
    raise CheckpointNotFoundError(
        f"no committed checkpoint in '{path}' (looked for step folders holding "
        f"{layout.METADATA_FILE}); start from scratch or point to another folder"
    )


def commit_record(storage: Storage, ckpt: str) -> CheckpointMetadata | None:
    """The commit record of step folder `ckpt`; None when it has none (not committed) or when
    the record is damaged, which is logged as a warning naming the file."""
    try:
        return records.read_metadata(storage, ckpt)
    except FileNotFoundError:
        return None
    except CorruptCheckpointError as e:
        log.warning("skipping '%s': %s", ckpt, e)
        return None


def read_metadata(storage: Storage, path: str) -> CheckpointMetadata:
    """The commit record of the checkpoint at `path`."""
    try:
        return records.read_metadata(storage, path)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(
            f"'{path}' is not a committed checkpoint: "
            f"'{storage.join(path, layout.METADATA_FILE)}' does not exist"
        ) from e


def saved_world_size(storage: Storage, path: str) -> int | None:
    """The world size recorded in a checkpoint's manifest; None without one (OLMo-core's)."""
    try:
        return records.read_manifest(storage, path).world_size
    except FileNotFoundError:
        return None


def dcp_folder(storage: Storage, path: str) -> str:
    """The DCP folder of a checkpoint: `model_and_optim/`, or the folder itself when bare."""
    nested = storage.join(path, layout.MODEL_DIR)
    if storage.exists(storage.join(nested, layout.DCP_METADATA_FILE)):
        return nested
    if storage.exists(storage.join(path, layout.DCP_METADATA_FILE)):
        return path
    if is_committed(storage, path):
        raise CorruptCheckpointError(
            f"'{path}' is committed but '{nested}/{layout.DCP_METADATA_FILE}' is missing; the "
            "checkpoint is damaged: load an older one or restore it from a copy"
        )
    require_folder(storage, path)  # a clearer error for a missing path or a file
    raise CheckpointNotFoundError(
        f"'{path}' is not a checkpoint (no {layout.METADATA_FILE}, no "
        f"{layout.MODEL_DIR}/{layout.DCP_METADATA_FILE}); check the path, or use "
        "Checkpointer.latest_checkpoint(folder) to find one"
    )
