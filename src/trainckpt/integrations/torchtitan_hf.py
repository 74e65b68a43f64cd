"""Hugging Face safetensors for the torchtitan manager: the final save (`last_save_in_hf`) and
the initial load (`initial_load_in_hf`), with torchtitan's state-dict adapter for the key names.

Saving: every rank gathers the full weights (DTensors are all-gathered), cast to
`export_dtype`; rank 0 converts them with the adapter's `to_hf` and writes sharded safetensors
(`model-0000i-of-0000N.safetensors`, split as the adapter's `fqn_to_index_mapping` says when
the model's Hugging Face index is known, else by size) and `model.safetensors.index.json`, all
through `Checkpointer.save_files`, so the folder commits like any checkpoint. The files are
written with `safetensors` itself rather than DCP's `HuggingFaceStorageWriter`: with full
tensors in one process there is nothing for DCP to plan, and its writer needs a second pass
to consolidate its per-rank files.

Loading: DCP's `HuggingFaceStorageReader` reads the safetensors (JSON headers and raw bytes:
nothing in the files is ever run) into the adapter's `to_hf` view of the model's state, in
parallel and sharded as the model is, then `from_hf` maps the names back.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainckpt.checkpointer import Checkpointer
from trainckpt.core import dist
from trainckpt.errors import ConfigurationError, CorruptCheckpointError
from trainckpt.format import layout
from trainckpt.format.torchtitan_layout import HF_INDEX_FILE
from trainckpt.storage import Storage, resolve

log = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 1024**3
"""Shard size when the model's own Hugging Face index is unknown (Hugging Face's default)."""
_MAX_INDEX_BYTES = 64 * 1024 * 1024


def is_hf_checkpoint(storage: Storage, path: str) -> bool:
    """True for a folder of safetensors with an index and no DCP metadata."""
    if storage.exists(storage.join(path, layout.DCP_METADATA_FILE)) or storage.exists(
        storage.join(path, layout.MODEL_DIR, layout.DCP_METADATA_FILE)
    ):
        return False
    return storage.exists(storage.join(path, HF_INDEX_FILE))


def _full(value: Any, dtype: torch.dtype) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "full_tensor"):  # a DTensor: every rank takes part in the gather
        value = value.full_tensor()
    value = value.detach().cpu()
    return value.to(dtype) if value.is_floating_point() else value


def _shards(hf_state: dict[str, torch.Tensor], mapping: dict[str, int] | None) -> list[list[str]]:
    """Keys per shard file: as the model's index maps them, else filled up to a size."""
    if mapping:
        count = max(mapping.values(), default=1)
        groups: list[list[str]] = [[] for _ in range(count)]
        for key in hf_state:
            groups[min(max(mapping.get(key, count), 1), count) - 1].append(key)
        return [g for g in groups if g]
    groups, size = [[]], 0
    for key, t in hf_state.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > MAX_SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return groups


def write_hf_files(
    hf_state: dict[str, torch.Tensor], mapping: dict[str, int] | None, folder: Path
) -> list[str]:
    """Write `hf_state` as sharded safetensors plus `model.safetensors.index.json` into
    `folder`; return the file names (index last)."""
    from safetensors.torch import save_file

    groups = _shards(hf_state, mapping)
    names, weight_map = [], {}
    for i, keys in enumerate(groups, start=1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        save_file(
            {k: hf_state[k].contiguous() for k in keys},
            str(folder / name),
            metadata={"format": "pt"},
        )
        names.append(name)
        weight_map.update({k: name for k in keys})
    total = sum(t.numel() * t.element_size() for t in hf_state.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / HF_INDEX_FILE).write_text(json.dumps(index, indent=2))
    return [*names, HF_INDEX_FILE]


def save_hf(
    checkpointer: Checkpointer,
    path: str,
    model_state: dict[str, Any],
    adapter: Any,
    export_dtype: str,
) -> str:
    """Save `model_state` (gathered whole, cast to `export_dtype`, named by torchtitan's
    state-dict `adapter`) as Hugging Face safetensors into the checkpoint `path`, committed by
    `checkpointer`; returns its path. Called on: all ranks."""
    start = time.perf_counter()
    dtype = getattr(torch, export_dtype)
    full = {k: _full(v, dtype) for k, v in model_state.items()}
    hf_state = adapter.to_hf(full)
    mapping = adapter.fqn_to_index_mapping  # read after to_hf: it drops tied weights from it
    checkpointer.wait()  # one save at a time
    committed = checkpointer.save_files(
        path, lambda local: write_hf_files(hf_state, mapping, local)
    )
    log.info(
        "saved Hugging Face safetensors to '%s' in %.2fs", committed, time.perf_counter() - start
    )
    return committed


def _check_index(folder: Path) -> None:
    """Refuse an index that is too big, not JSON, or names files outside the folder or
    missing, before DCP's reader opens anything."""
    index = folder / HF_INDEX_FILE
    if not index.exists():
        if not any(folder.glob("*.safetensors")):
            raise CorruptCheckpointError(
                f"'{folder}' holds no '{HF_INDEX_FILE}' and no .safetensors file; point "
                "initial_load_path at a Hugging Face model folder"
            )
        return
    if index.stat().st_size > _MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"'{index}' is larger than {_MAX_INDEX_BYTES} bytes")
    try:
        files = set(json.loads(index.read_text())["weight_map"].values())
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"'{index}' is not a safetensors index: {e}") from e
    for name in sorted(files):
        if not isinstance(name, str) or not layout.is_safe_relpath(name):
            raise CorruptCheckpointError(f"'{index}' names '{name}', outside the folder")
        if not (folder / name).is_file():
            raise CorruptCheckpointError(f"'{index}' names '{name}', which is missing")


def load_hf(
    path: str,
    model_state: dict[str, Any],
    load_weights: Callable[[dict[str, Any]], None],
    adapter: Any,
    group: dist.ProcessGroup | None,
) -> None:
    """Load Hugging Face safetensors from the local folder `path` into the model: read into
    the `adapter`'s `to_hf` view of its `model_state`, mapped back and handed to
    `load_weights` (the model's `load_state_dict`: model only), by the ranks of `group`.
    Called on: all ranks."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    storage, local = resolve(path)
    if not storage.atomic_rename:  # not a local path
        raise ConfigurationError(
            f"'{path}': Hugging Face safetensors load from a local folder only; download it "
            "first (torchtitan's own manager has the same limit)"
        )
    folder = Path(local)
    dist.run_on_rank0(lambda: _check_index(folder), f"checking '{folder}'", group)
    start = time.perf_counter()
    hf_state = adapter.to_hf(model_state)
    try:
        dcp_load(
            hf_state,
            storage_reader=HuggingFaceStorageReader(str(folder), thread_count=4),
            process_group=group,
            no_dist=not dist.is_distributed(),
        )
    except CheckpointException as e:
        first = next(iter(e.failures.values()), (e, None))[0]
        raise CorruptCheckpointError(
            f"loading Hugging Face safetensors from '{folder}' failed ({type(first).__name__}: "
            f"{first}); check that it holds this model's weights"
        ) from e
    load_weights(adapter.from_hf(hf_state))
    log.info("loaded Hugging Face safetensors '%s' in %.2fs", folder, time.perf_counter() - start)
