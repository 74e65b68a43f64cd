"""Checkpoints torchtitan wrote: `step-N` folders holding DCP files at their top (or Hugging
Face safetensors with an index), without trainckpt's commit record or manifest.

torchtitan counts a `step-N` folder as a checkpoint once DCP's `.metadata` is in it, and DCP
writes `.metadata` after the shards, so a folder with it is complete unless a file was lost or
cut afterwards. Without a manifest that is checked here from DCP's own metadata: every shard
file it names must exist and be long enough for every byte range it records. Pure reads through
the storage interface; nothing from the checkpoint is run (the metadata is read safely).
"""

from __future__ import annotations

from trainckpt.errors import CheckpointError
from trainckpt.format import layout
from trainckpt.format.folder import is_committed, step_folders
from trainckpt.storage import Storage

HF_INDEX_FILE = "model.safetensors.index.json"


def torchtitan_checkpoints(storage: Storage, path: str) -> list[tuple[int, str]]:
    """(step, path) of the `step-N` folders under `path` that torchtitan wrote (no commit
    record; DCP `.metadata` or a safetensors index inside), ascending by step."""
    found = []
    for f in step_folders(storage, path):
        if not layout.is_torchtitan_name(f.name) or is_committed(storage, f.path):
            continue
        if storage.exists(storage.join(f.path, layout.DCP_METADATA_FILE)) or storage.exists(
            storage.join(f.path, HF_INDEX_FILE)
        ):
            found.append((f.step, f.path))
    return found


def dcp_problems(storage: Storage, folder: str) -> list[str]:
    """What is wrong with the DCP folder `folder` by its own metadata: an unreadable
    `.metadata`, a missing shard file, or one shorter than the byte ranges recorded in it.
    An empty list means every recorded byte is there (not that every byte is right: DCP keeps
    no checksums)."""
    from trainckpt.format.dcp_metadata import (
        read_dcp_metadata,  # imported on first use: DCP is slow to import
    )

    try:
        metadata = read_dcp_metadata(storage, folder)
    except (CheckpointError, OSError) as e:
        return [str(e)]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    sizes = storage.list_dir(folder).files if storage.supports_listing else {}
    problems = []
    for name, end in sorted(needed.items()):
        size = sizes.get(name)
        if size is None:
            problems.append(f"'{storage.join(folder, name)}' is missing")
        elif size < end:
            problems.append(
                f"'{storage.join(folder, name)}' has {size} bytes; DCP's metadata records "
                f"data up to byte {end}"
            )
    return problems
