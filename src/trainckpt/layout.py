"""Names of the on-disk format (format 1): step folders, the `-tmp` suffix and fixed file names."""

from __future__ import annotations

import re
from typing import Final

FORMAT_VERSION: Final = 1
METADATA_FILE = ".metadata.json"
"""Commit record, written last. Its presence is what makes a folder a checkpoint."""
MANIFEST_FILE = ".manifest.json"
"""Sizes and CRC32C of every other file, written just before the commit record."""
TRAIN_DIR = "train"
MODEL_DIR = "model_and_optim"
DCP_METADATA_FILE = ".metadata"
"""torch.distributed.checkpoint's own metadata file inside a DCP folder."""
TMP_SUFFIX = "-tmp"

_STEP_RE = re.compile(r"^step(\d+)$")


def checkpoint_dirname(step: int) -> str:
    """Folder name of the checkpoint for `step`."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step{step}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint folder name, or None for anything else (including `-tmp`)."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def trainer_state_file(rank: int) -> str:
    """Path of rank `rank`'s trainer state, relative to the checkpoint folder."""
    return f"{TRAIN_DIR}/rank{rank}.pt"


def tmp_name(name: str) -> str:
    """Name of the working folder of a save in progress."""
    return name + TMP_SUFFIX


def is_safe_relpath(rel: str) -> bool:
    """True when `rel` stays inside the checkpoint folder (no `..`, not absolute, no backslash)."""
    if not rel or rel.startswith("/") or "\\" in rel or ":" in rel.split("/", 1)[0]:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))
