"""Names of the on-disk format (format 1): step folders, the `-tmp` suffix and fixed file names."""

from __future__ import annotations

import re
from typing import Final, Literal

FORMAT_VERSION: Final = 1
METADATA_FILE = ".metadata.json"
"""Commit record, written last. Its presence is what makes a folder a checkpoint."""
MANIFEST_FILE = ".manifest.json"
"""Sizes and CRC32C of every other file, written just before the commit record."""
CLAIM_FILE = ".claim"
"""Object stores: names the save (or deletion) that owns a step prefix while it runs
(`claim.py`); deleted after the commit, ignored by verify when a crash left it behind."""
TRAIN_DIR = "train"
MODEL_DIR = "model_and_optim"
DCP_METADATA_FILE = ".metadata"
"""torch.distributed.checkpoint's own metadata file inside a DCP folder."""
NATIVE_METADATA_FILE = ".metadata.trainckpt"
"""trainckpt's own description of the DCP folder, beside `.metadata` (`native_metadata`): read
instead of unpickling `.metadata`; DCP and other readers ignore it."""
TMP_SUFFIX = "-tmp"
REPLACED_SUFFIX = "-replaced"
"""Filesystems: where a save moves the old folder of its step (abandoned by a rollback,
uncommitted, or overwritten) just before renaming its `-tmp` into place, and deletes it right
after; a crash in between leaves it there, and the next save of that step puts it back."""
ABANDONED_FILE = ".abandoned.json"
"""Marks a step folder a rollback abandoned (docs/design.md §11): the run resumed from an older
step, so the commit record was removed (no finder reports the folder again) and kept in here.
The next save of that step replaces the folder."""

_STEP_RE = re.compile(r"^step(-?)(\d+)$")
_RANK_FILE_RE = re.compile(rf"^{TRAIN_DIR}/rank(\d+)\.pt$")

Naming = Literal["trainckpt", "torchtitan"]
"""Step folder names: `step1000` (trainckpt, OLMo-core) or `step-1000` (torchtitan). A
torchtitan-named checkpoint keeps its DCP files at its top level, where torchtitan reads them;
the commit record, manifest and trainer state sit beside them as in any checkpoint."""


def checkpoint_dirname(step: int, naming: Naming = "trainckpt") -> str:
    """Folder name of the checkpoint for `step`."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step}" if naming == "torchtitan" else f"step{step}"


def parse_step(name: str) -> int | None:
    """The step of a checkpoint folder name of either naming, or None for anything else
    (including `-tmp`)."""
    m = _STEP_RE.match(name)
    return int(m.group(2)) if m else None


def parse_step_folder(name: str) -> tuple[int, bool] | None:
    """(step, whether it is a working folder: `-tmp` or `-replaced`) of a step folder name of
    either naming, with or without such a suffix; None for any other name. The one place those
    suffixes are parsed (through `target_name`)."""
    base = target_name(name)
    step = parse_step(base)
    return None if step is None else (step, base != name)


def is_torchtitan_name(name: str) -> bool:
    """True for a torchtitan-named step folder (`step-1000`). Such a folder without a commit
    record is a checkpoint torchtitan wrote, never a leftover of ours to delete."""
    m = _STEP_RE.match(name)
    return bool(m and m.group(1))


def dcp_dirname(name: str) -> str:
    """Where the DCP files of checkpoint folder `name` go, relative to it ("" = its top)."""
    return "" if is_torchtitan_name(name) else MODEL_DIR


def trainer_state_file(rank: int) -> str:
    """Path of rank `rank`'s trainer state, relative to the checkpoint folder."""
    return f"{TRAIN_DIR}/rank{rank}.pt"


def parse_trainer_state_file(rel: str) -> int | None:
    """The rank of a trainer-state file path (`train/rank3.pt`, relative to the checkpoint
    folder), or None for any other path."""
    m = _RANK_FILE_RE.match(rel)
    return int(m.group(1)) if m else None


def tmp_name(name: str) -> str:
    """Name of the working folder of a save in progress."""
    return name + TMP_SUFFIX


def replaced_name(name: str) -> str:
    """Name the old folder of step folder `name` takes while a save swaps the new one in."""
    return name + REPLACED_SUFFIX


def target_name(name: str) -> str:
    """Name of the checkpoint folder that `name` is (or, for a `-tmp` or `-replaced` working
    folder, belongs to)."""
    for suffix in (TMP_SUFFIX, REPLACED_SUFFIX):
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def lock_name(name: str) -> str:
    """Local/NFS: name of the lock file beside checkpoint folder `name` that the save (or
    deletion) of it holds (`step_lock.py`); a hidden file, removed when released."""
    return f".{name}.lock"


def is_safe_relpath(rel: str) -> bool:
    """True when `rel` stays inside the checkpoint folder (no `..`, not absolute, no backslash)."""
    if not rel or rel.startswith("/") or "\\" in rel or ":" in rel.split("/", 1)[0]:
        return False
    return all(part not in ("", ".", "..") for part in rel.split("/"))
