"""Read-only reports on save folders and checkpoints, for the `trainckpt` command.

`scan_folder` lists every step folder of a save folder (committed, uncommitted and `-tmp`
leftovers) with its size and records; `describe_checkpoint` summarises one checkpoint: commit
record, manifest, trainer-state keys and every DCP value. Both go through the storage interface,
so they work on local folders and object stores alike, and both load nothing that could run code
(trainer state with `weights_only=True`, DCP metadata with the allow-list unpickler).
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainckpt.checkpointer import Checkpointer
from trainckpt.errors import CheckpointError, CheckpointNotFoundError
from trainckpt.format import layout
from trainckpt.format.dcp_metadata import read_dcp_metadata
from trainckpt.format.finders import dcp_folder
from trainckpt.format.records import (
    CheckpointManifest,
    CheckpointMetadata,
    read_manifest,
    read_metadata,
)
from trainckpt.format.trainer_state import deserialize_trainer_state
from trainckpt.storage import Storage, resolve

FolderState = Literal["committed", "damaged", "uncommitted", "tmp"]
"""`damaged`: a commit record is there, but it or the manifest cannot be read (see the note);
finders skip such a folder, retention and `prune` keep it for a person to look at."""

_RANK_FILE_RE = re.compile(rf"^{layout.TRAIN_DIR}/rank\d+\.pt$")


@dataclass(frozen=True)
class FolderEntry:
    """One step folder of a save folder, as `trainckpt ls` shows it."""

    name: str
    path: str
    step: int
    state: FolderState
    ephemeral: bool | None
    """From the commit record; None when not committed or the record cannot be read."""
    size: int
    files: int
    created_at: str | None
    """From the manifest (UTC ISO-8601); None without one."""
    world_size: int | None
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "step": self.step,
            "state": self.state,
            "ephemeral": self.ephemeral,
            "size": self.size,
            "files": self.files,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "note": self.note,
        }


def scan_folder(folder: str) -> tuple[str, list[FolderEntry]]:
    """The canonical path of `folder` and its step folders (`stepN`, committed or not, and
    `stepN-tmp`), by step then name. Other folders and files are ignored. One listing of the
    folder, one listing per step folder, and a read of each commit record and manifest."""
    storage, path = resolve(folder)
    listing = storage.list_dir(path)
    entries: list[FolderEntry] = []
    for name in listing.dirs:
        step = layout.parse_step(name)
        tmp = False
        if step is None and name.endswith(layout.TMP_SUFFIX):
            step = layout.parse_step(name[: -len(layout.TMP_SUFFIX)])
            tmp = True
        if step is None:
            continue
        try:
            entry = _describe_entry(storage, storage.join(path, name), name, step, tmp)
        except CheckpointNotFoundError:  # gone since the listing (a save renamed its -tmp)
            continue
        if entry.state == "uncommitted" and layout.is_torchtitan_name(name):
            continue  # a checkpoint torchtitan wrote: neither ours to list nor to prune
        entries.append(entry)
    entries.sort(key=lambda e: (e.step, e.name))
    return path, entries


def _describe_entry(storage: Storage, path: str, name: str, step: int, tmp: bool) -> FolderEntry:
    files = storage.list_files(path)
    committed = layout.METADATA_FILE in files
    state: FolderState = "tmp" if tmp else "committed" if committed else "uncommitted"
    notes: list[str] = []
    damaged: list[str] = []
    ephemeral: bool | None = None
    if committed:
        try:
            ephemeral = read_metadata(storage, path).ephemeral
        except CheckpointError as e:
            damaged.append(f"unreadable commit record: {e}")
    manifest: CheckpointManifest | None = None
    if layout.MANIFEST_FILE in files:
        try:
            manifest = read_manifest(storage, path)
        except CheckpointError as e:
            damaged.append(f"unreadable manifest: {e}")
    elif committed:
        notes.append("no manifest (unverifiable)")
    if layout.CLAIM_FILE in files and not committed:
        notes.append("claimed: a save in progress, or a crashed one the next save takes over")
    if damaged and state == "committed":
        state = "damaged"
    notes = damaged + notes
    world_size = manifest.world_size if manifest else _count_rank_files(files)
    return FolderEntry(
        name=name,
        path=path,
        step=step,
        state=state,
        ephemeral=ephemeral,
        size=sum(files.values()),
        files=len(files),
        created_at=manifest.created_at if manifest else None,
        world_size=world_size,
        note="; ".join(notes),
    )


def manifest_bytes(ckpt: str) -> int | None:
    """Total size of the files a checkpoint's manifest lists, or None without a readable one."""
    storage, path = resolve(ckpt)
    try:
        manifest = read_manifest(storage, path)
    except (CheckpointError, FileNotFoundError):
        return None
    return sum(e.size for e in manifest.files.values())


def _count_rank_files(files: dict[str, int]) -> int | None:
    """World size guessed from `train/rank{R}.pt` files (checkpoints without a manifest)."""
    ranks = sum(1 for rel in files if _RANK_FILE_RE.match(rel))
    return ranks or None


def age_seconds(created_at: str | None, now: _dt.datetime | None = None) -> float | None:
    """Seconds since an ISO-8601 timestamp, or None when there is none or it cannot be parsed."""
    if not created_at:
        return None
    try:
        then = _dt.datetime.fromisoformat(created_at)
    except ValueError:
        return None
    if then.tzinfo is None:
        then = then.replace(tzinfo=_dt.timezone.utc)
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return max(0.0, (now - then).total_seconds())


# -- one checkpoint ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueInfo:
    """One value of a DCP checkpoint: a tensor (shape, dtype, bytes) or a plain value."""

    key: str
    kind: Literal["tensor", "value"]
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    nbytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "kind": self.kind,
            "dtype": self.dtype,
            "shape": list(self.shape) if self.shape is not None else None,
            "nbytes": self.nbytes,
        }


@dataclass(frozen=True)
class CheckpointReport:
    """What `trainckpt inspect` shows about one checkpoint."""

    path: str
    dcp_folder: str
    metadata: CheckpointMetadata | None
    """None for a bare DCP folder (model weights without a commit record)."""
    manifest: CheckpointManifest | None
    trainer_state_files: list[str]
    trainer_state: dict[str, str]
    """Rank 0's trainer state: key -> short description of the value."""
    values: list[ValueInfo]
    notes: list[str] = field(default_factory=list)

    def bytes_by_group(self) -> dict[str, int]:
        """Tensor bytes per top-level key (`model`, `optim`, ...)."""
        out: dict[str, int] = {}
        for v in self.values:
            group = v.key.split(".", 1)[0]
            out[group] = out.get(group, 0) + v.nbytes
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "dcp_folder": self.dcp_folder,
            "metadata": self.metadata.model_dump() if self.metadata else None,
            "manifest": (
                {
                    "format": self.manifest.format,
                    "step": self.manifest.step,
                    "created_at": self.manifest.created_at,
                    "world_size": self.manifest.world_size,
                    "files": len(self.manifest.files),
                    "size": sum(e.size for e in self.manifest.files.values()),
                }
                if self.manifest
                else None
            ),
            "trainer_state_files": self.trainer_state_files,
            "trainer_state": self.trainer_state,
            "bytes_by_group": self.bytes_by_group(),
            "values": [v.to_json() for v in self.values],
            "notes": self.notes,
        }


def describe_checkpoint(ckpt: str) -> CheckpointReport:
    """Summarise one checkpoint (or a bare DCP folder). Raises `CheckpointNotFoundError` when
    `ckpt` is neither, naming the newest checkpoint inside it when it is a save folder."""
    storage, path = resolve(ckpt)
    dcp_folder = checkpoint_dcp_folder(storage, path)
    notes: list[str] = []
    metadata: CheckpointMetadata | None = None
    if storage.exists(storage.join(path, layout.METADATA_FILE)):
        metadata = Checkpointer.read_metadata(path)
    elif dcp_folder == path:
        notes.append("no commit record: a bare DCP folder (model weights only)")
    else:
        notes.append(
            "NOT COMMITTED (no commit record): left by an interrupted save, possibly incomplete; "
            "finders skip it and the next save of this step or `trainckpt prune` removes it"
        )
    manifest: CheckpointManifest | None = None
    if storage.exists(storage.join(path, layout.MANIFEST_FILE)):
        manifest = read_manifest(storage, path)
    elif metadata is not None:
        notes.append("no manifest: the checkpoint cannot be verified (written by OLMo-core?)")
    rank_files = _trainer_state_files(storage, path)
    trainer_state: dict[str, str] = {}
    if rank_files:
        where = storage.join(path, rank_files[0])
        state = deserialize_trainer_state(storage.read_bytes(where), where)
        trainer_state = {str(k): describe_value(v) for k, v in state.items()}
    dcp_md = read_dcp_metadata(storage, dcp_folder)
    values = [_value_info(key, md) for key, md in dcp_md.state_dict_metadata.items()]
    return CheckpointReport(
        path=path,
        dcp_folder=dcp_folder,
        metadata=metadata,
        manifest=manifest,
        trainer_state_files=rank_files,
        trainer_state=trainer_state,
        values=values,
        notes=notes,
    )


def checkpoint_dcp_folder(storage: Storage, path: str, command: str = "inspect {}") -> str:
    """The DCP folder of checkpoint `path`. When `path` is no checkpoint, the error says
    whether it is a file, does not exist or is a save folder (naming its newest checkpoint
    and the `trainckpt` `command` to run on it)."""
    try:
        return dcp_folder(storage, path)
    except CheckpointNotFoundError:
        require_one_checkpoint(storage, path, command)
        raise


def require_one_checkpoint(storage: Storage, path: str, command: str) -> None:
    """Refuse, as a usage mistake (`CheckpointNotFoundError`), a `path` that is a file, does
    not exist, is empty or is a folder of checkpoints rather than one; the message names the
    `trainckpt` command to use instead (`command`, with `{}` where the checkpoint goes). A
    checkpoint, a bare DCP folder or an uncommitted step folder (whose problems the caller
    reports) passes."""
    if Checkpointer.dir_is_checkpoint(path):
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
        latest = Checkpointer.latest_checkpoint(path)
    except CheckpointError:
        return
    raise CheckpointNotFoundError(
        f"'{path}' holds checkpoints but is not one; pass one of them, e.g. the newest: "
        f"`trainckpt {command.format(latest)}` (`trainckpt ls {path}` lists them all)"
    )


def _trainer_state_files(storage: Storage, path: str) -> list[str]:
    """`train/rank{R}.pt` files of a checkpoint, by rank."""
    try:
        listing = storage.list_dir(storage.join(path, layout.TRAIN_DIR))
    except FileNotFoundError:
        return []
    ranks = sorted(
        int(m.group(1)) for name in listing.files if (m := re.match(r"^rank(\d+)\.pt$", name))
    )
    return [layout.trainer_state_file(r) for r in ranks]


def _value_info(key: str, md: Any) -> ValueInfo:
    if isinstance(md, TensorStorageMetadata):
        dtype = md.properties.dtype
        shape = tuple(md.size)
        numel = 1
        for d in shape:
            numel *= d
        return ValueInfo(
            key=key,
            kind="tensor",
            dtype=str(dtype).removeprefix("torch."),
            shape=shape,
            nbytes=numel * dtype.itemsize,
        )
    return ValueInfo(key=key, kind="value")


def describe_value(value: Any, limit: int = 60) -> str:
    """A one-line description of a trainer-state value: tensors by shape and dtype, containers
    by length, plain values by their (shortened) repr."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.")
        if value.numel() == 1 and value.dim() == 0:
            return f"tensor({value.item()!r}, {dtype})"
        return f"tensor(shape={list(value.shape)}, {dtype})"
    if isinstance(value, dict):
        return f"dict with {len(value)} keys"
    if isinstance(value, (list, tuple)) and len(repr(value)) > limit:
        return f"{type(value).__name__} of {len(value)}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
