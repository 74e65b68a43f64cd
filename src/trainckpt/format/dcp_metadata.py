"""A DCP folder's metadata, read as hostile input: size-bounded (a bound that grows with the
folder's shard files, `records.dcp_metadata_bound`), optionally checked against the manifest
first, then parsed from trainckpt's own record (`native_metadata`, no unpickling) where there
is one, else from DCP's `.metadata`, unpickled only by the exact allow-list in `safe_unpickle`.

Called on: any rank that plans a load, and offline tools (inspect, export, verify)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch.distributed.checkpoint.metadata import Metadata

from trainckpt.format import native_metadata
from trainckpt.format.layout import DCP_METADATA_FILE, NATIVE_METADATA_FILE
from trainckpt.format.records import (
    DCP_METADATA_FLOOR_BYTES,
    CheckpointManifest,
    dcp_metadata_bound,
    read_record_bytes,
)
from trainckpt.format.safe_unpickle import load_dcp_metadata
from trainckpt.storage import Storage

log = logging.getLogger(__name__)


def read_dcp_metadata(
    storage: Storage,
    folder: str,
    check: Callable[[str, bytes, str], None] | None = None,
    *,
    native: bool = True,
) -> Metadata:
    """The metadata of the DCP folder `folder`: from trainckpt's own record
    (`.metadata.trainckpt`, parsed without unpickling) when `native` and the folder has one,
    else from DCP's `.metadata` through the safe unpickler. `check(name, data, where)` may
    refuse the bytes of either file first (e.g. against the manifest)."""
    if native:
        where = storage.join(folder, NATIVE_METADATA_FILE)
        try:
            data = _read_bounded(storage, folder, where)
        except FileNotFoundError:
            pass  # written by DCP, OLMo-core, torchtitan or trainckpt before 0.3
        else:
            if check is not None:
                check(NATIVE_METADATA_FILE, data, where)
            return native_metadata.decode(data, where)
    where = storage.join(folder, DCP_METADATA_FILE)
    data = _read_bounded(storage, folder, where)
    if check is not None:
        check(DCP_METADATA_FILE, data, where)
    return load_dcp_metadata(data, where)


def _read_bounded(storage: Storage, folder: str, where: str) -> bytes:
    """The bytes of the metadata file `where` of `folder`, at most the floor, or past it at
    most `dcp_metadata_bound` of the folder's shard files."""
    data = storage.read_bytes(where, 0, DCP_METADATA_FLOOR_BYTES + 1)
    if len(data) > DCP_METADATA_FLOOR_BYTES:  # past the floor: the folder's shards decide
        del data
        data = read_record_bytes(storage, where, dcp_metadata_bound(_shard_bytes(storage, folder)))
    return data


def _shard_bytes(storage: Storage, folder: str) -> int:
    """The size of the `.distcp` shard files directly in `folder`; 0 where it cannot be
    listed (HTTP): the floor is the bound there."""
    try:
        listing = storage.list_files(folder)
    except Exception as e:
        log.info("cannot list '%s' (%s): its .metadata is bounded by the floor", folder, e)
        return 0
    return sum(size for rel, size in listing.items() if "/" not in rel and rel.endswith(".distcp"))


def native_record_current(
    storage: Storage, folder: str, manifest: CheckpointManifest | None, prefix: str
) -> bool:
    """Whether a load may read trainckpt's own metadata record instead of `.metadata`: only
    when the manifest was read (not with `verify_on_load="none"`), lists the record, and
    `.metadata` still has the size it records. Another writer that saved the step again in
    place (torchtitan's own manager) rewrites `.metadata` and the shards but leaves our record,
    which then describes files that are gone. `prefix`: the DCP folder's path in the
    checkpoint ("" or "model_and_optim/"). Called on: every rank of a load, or one process
    (one size query)."""
    if manifest is None:
        return False
    entry = manifest.files.get(f"{prefix}{DCP_METADATA_FILE}")
    if f"{prefix}{NATIVE_METADATA_FILE}" not in manifest.files or entry is None:
        return False
    try:
        return storage.size(storage.join(folder, DCP_METADATA_FILE)) == entry.size
    except FileNotFoundError:
        return False
