"""The item record at the end of each DCP shard file trainckpt writes: which file it is, which
save wrote it, and the CRC32C of every item in it.

A shard file is a run of `torch.save`d items at offsets that DCP's `.metadata` records; readers
(plain DCP, OLMo-core, ours) read only those byte ranges, so a record appended after the last
item changes nothing for them. Layout: JSON `{"file", "save_id", "items": [[offset, length,
crc32c], ...]}`, then its length (8 bytes, little-endian), then `MAGIC`.

The save id is chosen once per save by DCP's coordinator and also written into `.metadata`
(`storage_meta.save_id`). The reader checks, at no extra read of the data, that each shard file
names itself and this save (a file swapped within a checkpoint, or copied in from another, is
caught when opened) and that the bytes of each item it loads have the recorded CRC32C.

An incremental save (`core/incremental.py`) takes unchanged shard files over from the previous
checkpoint as they are, records and all: its `.metadata` then names its own save id followed by
the ids of the saves that wrote those files, comma-separated (`join_save_ids`), and a shard may
name any of them (`save_ids`).
"""

from __future__ import annotations

import io
import json
import struct
import uuid
from dataclasses import dataclass
from typing import Any

import google_crc32c

from trainckpt.errors import CorruptCheckpointError
from trainckpt.storage.checksummed_file import crc32c_extend

MAGIC = b"TCKPTIR1"
SAVE_ID_PREFIX = "trainckpt-items-1:"
"""`.metadata`'s `storage_meta.save_id` starts with this when every shard has an item record."""

_FOOTER = struct.Struct("<Q8s")
_TAIL = 64 * 1024  # one read fetches the whole record of a shard with up to ~2,000 items
_MAX_RECORD = 256 * 1024 * 1024
_CHUNK = 8 << 20
_SMALL = 1 << 20  # below this, checksummed_file copies to bytes anyway

_REDO = "load an older checkpoint (Checkpointer.find_latest_good) or restore this one from a copy"


def new_save_id() -> str:
    return SAVE_ID_PREFIX + uuid.uuid4().hex


def join_save_ids(own: str, others: set[str]) -> str:
    """`.metadata`'s save id field: this save's id, then those of the saves that wrote the
    files it took over (each id starts with `SAVE_ID_PREFIX` and holds no comma)."""
    return ",".join([own, *sorted(others - {own})])


def save_ids(field: str) -> frozenset[str]:
    """The save ids a checkpoint's shards may name, from its `.metadata` field."""
    return frozenset(field.split(","))


def encode(file: str, save_id: str, items: list[tuple[int, int, int]]) -> bytes:
    """The record of shard `file` of save `save_id` holding `items` (offset, length, crc32c):
    the bytes `json.dumps` gives for it, with each row formatted by one C call instead of a
    list per row for the JSON encoder (a shard holds tens of thousands of small items)."""
    rows = ", ".join(map(_ROW.__mod__, items))
    body = f'{{"file": {json.dumps(file)}, "save_id": {json.dumps(save_id)}, "items": [{rows}]}}'
    data = body.encode()
    return data + _FOOTER.pack(len(data), MAGIC)


_ROW = '[%d, %d, "%08x"]'


@dataclass(frozen=True)
class ItemRecord:
    file: str
    save_id: str
    items: dict[int, tuple[int, int]]
    """offset -> (length, crc32c)."""

    def check_identity(self, where: str, file: str, save_ids: frozenset[str]) -> None:
        """Raise unless this record names shard `file` and one of the saves `save_ids`."""
        if self.file != file or self.save_id not in save_ids:
            expected = " or ".join(sorted(save_ids))
            raise CorruptCheckpointError(
                f"'{where}' is not the file this checkpoint's DCP metadata expects there: it "
                f"holds '{self.file}' of save {self.save_id}, not '{file}' of save {expected} "
                f"(shard files were swapped, or copied in from another checkpoint); {_REDO}"
            )

    def check_item(self, where: str, offset: int, data: bytes | memoryview, what: str) -> None:
        """Raise unless `data`, read at `offset`, is the item the record lists there."""
        length, crc = self.items.get(offset, (-1, -1))
        if length != len(data):
            raise CorruptCheckpointError(
                f"'{where}' has no item of {len(data)} bytes at offset {offset} ({what}) in its "
                f"item record; the file does not match the checkpoint's DCP metadata; {_REDO}"
            )
        actual = crc32c(data)
        if actual != crc:
            raise CorruptCheckpointError(
                f"'{where}' is corrupt: bytes {offset}-{offset + length} ({what}) have CRC32C "
                f"{actual:08x}, written as {crc:08x}; {_REDO}"
            )


def read(stream: Any, where: str) -> ItemRecord:
    """The item record at the end of the open shard file `stream` (seekable; remote streams
    fetch the tail in one ranged read). Raises `CorruptCheckpointError` naming `where` when
    there is none or it is damaged."""
    size = stream.seek(0, io.SEEK_END)
    stream.seek(max(0, size - _TAIL))
    tail = _read_exactly(stream, min(size, _TAIL))
    if len(tail) < _FOOTER.size or tail[-len(MAGIC) :] != MAGIC:
        raise CorruptCheckpointError(
            f"'{where}' has no trainckpt item record at its end, which every shard of this "
            f"checkpoint was written with (the file was replaced or truncated); {_REDO}"
        )
    length, _ = _FOOTER.unpack(tail[-_FOOTER.size :])
    if length > min(size - _FOOTER.size, _MAX_RECORD):
        raise _damaged(where, f"a record length of {length} bytes")
    if length + _FOOTER.size > len(tail):
        stream.seek(size - _FOOTER.size - length)
        body = _read_exactly(stream, length)
    else:
        body = tail[-_FOOTER.size - length : -_FOOTER.size]
    try:
        raw = json.loads(body)
        items = {int(o): (int(n), int(c, 16)) for o, n, c in raw["items"]}
        file, save_id = raw["file"], raw["save_id"]
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise _damaged(where, f"{type(e).__name__}: {e}") from e
    if not isinstance(file, str) or not isinstance(save_id, str):
        raise _damaged(where, "no file name or save id")
    return ItemRecord(file=file, save_id=save_id, items=items)


def crc32c(data: bytes | memoryview) -> int:
    """The CRC32C of `data`: small items (most of a state of many entries) in one call on a
    copy; larger ones in place, in chunks, without the interpreter lock where the native
    library is there."""
    if len(data) < _SMALL:  # one copy and one call: less than addressing it in place
        return google_crc32c.value(data if type(data) is bytes else bytes(data))  # type: ignore[no-any-return]
    view = memoryview(data).cast("B")
    crc = 0
    for start in range(0, len(view), _CHUNK):
        crc = crc32c_extend(crc, view[start : start + _CHUNK])
    return crc


def _read_exactly(stream: Any, n: int) -> bytes:
    parts, got = [], 0
    while got < n:
        chunk = stream.read(n - got)
        if not chunk:
            break
        parts.append(chunk)
        got += len(chunk)
    return b"".join(parts)


def _damaged(where: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"'{where}' has a damaged item record ({what}); {_REDO}")
