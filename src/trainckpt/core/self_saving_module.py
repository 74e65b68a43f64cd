"""OLMo-core's "direct" train-module API: modules (e.g. OLMo-core's `OLMoDDPTrainModule`) that
write and read their DCP folder themselves, through `save_state_dict_direct(dir, ...)` and
`load_state_dict_direct(dir, ...)`, instead of handing over a state dict.

trainckpt calls them with the keywords OLMo-core's own `Checkpointer` passes, inside its commit
protocol: the module writes into the save's working folder, and what it wrote goes into the
manifest like any other file. Reading is the module's own: trainckpt checks the files against
the manifest and reads DCP's `.metadata` with its allow-list first, but the module's reader
then loads the shards itself (OLMo-core's unpickles them).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from trainckpt.core import dist
from trainckpt.errors import CheckpointError, ConfigurationError, StorageError
from trainckpt.storage.checksums import FileEntry, crc32c_file
from trainckpt.storage.local import fsync_dir

SAVE = "save_state_dict_direct"
LOAD = "load_state_dict_direct"

_SHARD = re.compile(r"^__(\d+)_\d+\.distcp$")
"""DCP's shard file names: `__{rank}_{i}.distcp`, the rank being the writer's rank in the
process group (torch's and OLMo-core's writers both name them so)."""


def saves_directly(module: Any) -> bool:
    return hasattr(module, SAVE)


def loads_directly(module: Any) -> bool:
    return hasattr(module, LOAD)


def save_direct(
    module: Any,
    folder: Path,
    prefix: str,
    *,
    group: dist.ProcessGroup | None,
    thread_count: int,
    durable: bool,
) -> dict[str, FileEntry]:
    """Have `module` write its DCP folder at `folder` (local: in the save's working or staging
    folder); return the files this rank wrote, named `prefix` + their path in `folder`, with
    size and CRC32C: its own `__{rank}_*` shards, and on rank 0 `.metadata` and anything else.

    Called on: all ranks (the module's DCP save is collective on `group`).
    """
    if not prefix:
        raise ConfigurationError(
            f"{type(module).__name__} writes its DCP folder itself, which needs a folder of "
            f"its own: save it to a 'stepN' checkpoint (DCP in 'stepN/model_and_optim'), not "
            f"to '{folder}', whose DCP files would sit beside the trainer state"
        )
    from trainckpt.core.dcp import plain_errors  # imported on first use: DCP takes ~1 s to import

    # Every rank creates it: with per-rank staging folders (object stores), OLMo-core's
    # preparation would otherwise wait on ranks > 0 for a folder only rank 0 creates.
    folder.mkdir(parents=True, exist_ok=True)
    with plain_errors(f"{type(module).__name__}.{SAVE} into '{folder}'", StorageError):
        getattr(module, SAVE)(
            str(folder),
            process_group=group,
            save_overwrite=False,  # the folder is new: the commit protocol decides overwrites
            thread_count=thread_count,
            throttle_uploads=False,  # it writes local files; trainckpt uploads them
        )
    if durable:
        fsync_dir(folder)
    rank = dist.get_rank(group)
    mine = [p for p in sorted(folder.rglob("*")) if p.is_file() and _owner(p, folder) == rank]
    return {prefix + p.relative_to(folder).as_posix(): crc32c_file(p) for p in mine}


def _owner(path: Path, folder: Path) -> int:
    """The rank that lists `path` in its part of the manifest: the writer of a shard, rank 0
    for `.metadata` and any other file."""
    match = _SHARD.match(path.name) if path.parent == folder else None
    return int(match.group(1)) if match else 0


def load_direct(
    module: Any,
    folder: str,
    *,
    group: dist.ProcessGroup | None,
    pre_download: bool,
    work_dir: Path,
    thread_count: int,
    load_optim_state: bool | None,
    reset_optimizer_states_on_load: bool | None,
) -> None:
    """Have `module` load the DCP folder `folder` (a local path or URL) itself.

    Called on: all ranks (the module's DCP load is collective on `group`).
    """
    from trainckpt.core.dcp import plain_errors

    with plain_errors(f"{type(module).__name__}.{LOAD} from '{folder}'", CheckpointError):
        getattr(module, LOAD)(
            folder,
            process_group=group,
            pre_download=pre_download,
            work_dir=work_dir,
            thread_count=thread_count,
            load_optim_state=load_optim_state,
            reset_optimizer_states_on_load=reset_optimizer_states_on_load,
        )
