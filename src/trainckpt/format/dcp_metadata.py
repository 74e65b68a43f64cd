"""DCP's `.metadata` record, read as hostile input: size-bounded, optionally checked against the
manifest first, and unpickled only by the exact allow-list in `safe_unpickle`.

Called on: any rank that plans a load, and offline tools (inspect, export, verify)."""

from __future__ import annotations

from collections.abc import Callable

from torch.distributed.checkpoint.metadata import Metadata

from trainckpt.errors import CorruptCheckpointError
from trainckpt.format.layout import DCP_METADATA_FILE
from trainckpt.format.records import MAX_DCP_METADATA_BYTES, read_record_bytes
from trainckpt.format.safe_unpickle import load_dcp_metadata
from trainckpt.storage import Storage


def read_dcp_metadata(
    storage: Storage, folder: str, check: Callable[[bytes, str], None] | None = None
) -> Metadata:
    """DCP's `.metadata` of `folder`, read safely; `check(data, where)` may refuse its bytes
    first (e.g. against the manifest)."""
    where = storage.join(folder, DCP_METADATA_FILE)
    data = read_record_bytes(storage, where, MAX_DCP_METADATA_BYTES)
    if check is not None:
        check(data, where)
    md = load_dcp_metadata(data, where)
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{where} does not hold DCP metadata")
    return md
