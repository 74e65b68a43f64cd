"""Checks of the `trainckpt` command's arguments that need no torch: is this one checkpoint?"""

from __future__ import annotations

from trainckpt.errors import CheckpointError, CheckpointNotFoundError
from trainckpt.format import folder
from trainckpt.storage import Storage


def require_one_checkpoint(storage: Storage, path: str, command: str) -> None:
    """Refuse, as a usage mistake (`CheckpointNotFoundError`), a `path` that is a file, does
    not exist, is empty or is a folder of checkpoints rather than one; the message names the
    `trainckpt` command to use instead (`command`, with `{}` where the checkpoint goes). A
    checkpoint, a bare DCP folder or an uncommitted step folder (whose problems the caller
    reports) passes."""
    if folder.is_checkpoint(storage, path):
        return
    if storage.exists(path):
        raise CheckpointNotFoundError(
            f"'{path}' is a file, not a checkpoint folder: pass the step folder of a "
            "checkpoint (`trainckpt ls FOLDER` lists those of a save folder)"
        )
    try:
        listing = storage.list_dir(path)
    except FileNotFoundError:
        listing = None
    if listing is None or (not listing.dirs and not listing.files):
        raise CheckpointNotFoundError(
            f"'{path}' does not exist (or is empty): check the path; "
            "`trainckpt ls FOLDER` lists the checkpoints of a save folder"
        )
    try:
        latest = folder.latest_checkpoint(storage, path)
    except CheckpointError:
        return
    raise CheckpointNotFoundError(
        f"'{path}' holds checkpoints but is not one; pass one of them, e.g. the newest: "
        f"`trainckpt {command.format(latest)}` (`trainckpt ls {path}` lists them all)"
    )
