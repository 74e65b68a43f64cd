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
from trainckpt.format.records import read_manifest
from trainckpt.format.verify import check_crcs
from trainckpt.storage import Storage

HF_INDEX_FILE = "model.safetensors.index.json"


def torchtitan_checkpoints(storage: Storage, path: str) -> list[tuple[int, str]]:
    """(step, path) of the `step-N` folders under `path` that torchtitan wrote (no commit
    record; DCP `.metadata` or a safetensors index inside), ascending by step. A folder with
    trainckpt's manifest but no commit record is ours, not torchtitan's (a deletion or rollback
    removed its commit record), as is one a rollback abandoned (`folder.abandon_newer`)."""
    found = []
    for f in step_folders(storage, path):
        if not layout.is_torchtitan_name(f.name) or is_committed(storage, f.path):
            continue
        files = storage.list_files(f.path)
        if layout.MANIFEST_FILE in files or layout.ABANDONED_FILE in files:
            continue
        if layout.DCP_METADATA_FILE in files or HF_INDEX_FILE in files:
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
        metadata = read_dcp_metadata(storage, folder, native=False)
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


def rewritten_by_another_writer(storage: Storage, ckpt: str) -> str | None:
    """Why checkpoint `ckpt` of ours, whose files fail verification, holds a complete DCP
    checkpoint that another writer (torchtitan's own manager re-saving the step in place) put
    over ours; None when it does not, i.e. when it is damaged.

    It does when all of these hold: DCP's `.metadata` is readable and names at least one shard
    file; every shard file it names is there with every byte it records (`dcp_problems`); and
    neither `.metadata` nor any of those files matches what our manifest recorded (size, then
    CRC32C). One file of ours left intact among them (a flipped byte or a lost file elsewhere)
    means damage, not a rewrite. Files `.metadata` does not name (our other shards, our trainer
    state) are not read by DCP and not checked. Nothing checks the values themselves: DCP keeps
    no checksums. Called on: one process (rank 0).
    """
    from trainckpt.format.dcp_metadata import read_dcp_metadata  # slow to import

    try:
        manifest = read_manifest(storage, ckpt)
        sub = layout.dcp_dirname(storage.name(ckpt))
        folder = storage.join(ckpt, sub) if sub else ckpt
        metadata = read_dcp_metadata(storage, folder, native=False)
    except (CheckpointError, OSError):
        return None
    named = sorted({info.relative_path for info in (metadata.storage_data or {}).values()})
    if not named or dcp_problems(storage, folder):
        return None
    listing = storage.list_files(ckpt)
    prefix = f"{sub}/" if sub else ""
    for name in (layout.DCP_METADATA_FILE, *named):
        rel = prefix + name
        entry = manifest.files.get(rel)
        if entry is None or listing.get(rel) != entry.size:
            continue  # not ours, or not as we wrote it
        if not check_crcs(storage, ckpt, [(rel, entry)]):
            return None  # a file exactly as we wrote it: our checkpoint, damaged
    return (
        f"its DCP files ({layout.DCP_METADATA_FILE} and {len(named)} shard file(s)) form a "
        "complete checkpoint and none of them is the file trainckpt's manifest records: "
        "another writer (e.g. torchtitan's own manager) saved this step again in place"
    )
