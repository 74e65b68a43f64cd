"""`trainckpt inspect`: what one checkpoint holds, as data the command prints.

`describe_checkpoint` summarises one checkpoint: commit record, manifest, trainer-state keys
and every DCP value. It goes through the storage interface, so it works on local folders and
object stores alike, and loads nothing that could run code (trainer state with
`weights_only=True`, DCP metadata with the allow-list unpickler). What a save folder holds is
`format.folder`'s; how it is printed is `cli.output`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainckpt.cli.checks import require_one_checkpoint
from trainckpt.errors import CheckpointNotFoundError
from trainckpt.format import folder, layout
from trainckpt.format.dcp_metadata import native_record_current, read_dcp_metadata
from trainckpt.format.records import CheckpointManifest, CheckpointMetadata, read_manifest
from trainckpt.format.trainer_state import (
    DEFAULT_MAX_BYTES,
    deserialize_trainer_state,
    read_trainer_state,
)
from trainckpt.storage import Storage, resolve


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
        metadata = folder.read_metadata(storage, path)
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
        data = read_trainer_state(storage, where, DEFAULT_MAX_BYTES)
        state = deserialize_trainer_state(data, where)
        trainer_state = {str(k): describe_value(v) for k, v in state.items()}
    prefix = "" if dcp_folder == path else f"{storage.name(dcp_folder)}/"
    dcp_md = read_dcp_metadata(
        storage, dcp_folder, native=native_record_current(storage, dcp_folder, manifest, prefix)
    )
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
        return folder.dcp_folder(storage, path)
    except CheckpointNotFoundError:
        require_one_checkpoint(storage, path, command)
        raise


def _trainer_state_files(storage: Storage, path: str) -> list[str]:
    """`train/rank{R}.pt` files of a checkpoint, by rank."""
    try:
        listing = storage.list_dir(storage.join(path, layout.TRAIN_DIR))
    except FileNotFoundError:
        return []
    ranks = (layout.parse_trainer_state_file(f"{layout.TRAIN_DIR}/{n}") for n in listing.files)
    return [layout.trainer_state_file(r) for r in sorted(r for r in ranks if r is not None)]


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
