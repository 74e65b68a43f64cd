"""The item record at the end of each DCP shard file trainckpt writes: which file it is, which
save wrote it, and the CRC32C of every item in it.

A shard file is a run of `torch.save`d items at offsets that DCP's `.metadata` records; readers
(plain DCP, OLMo-core, ours) read only those byte ranges, so a record appended after the last
item changes nothing for them. Layout (`docs/design.md`, "On-disk layout"; all integers
little-endian):

- the record's body: the length of a JSON header (4 bytes), the header `{"file", "save_id",
  "items": n}`, then the n items' offsets (8 bytes each), their lengths (8 bytes each) and
  their CRC32Cs (4 bytes each): packed and unpacked in C, since a shard of a state with many
  small entries holds a hundred thousand items;
- the body's length (8 bytes), then `MAGIC`.

Shards written before this layout end with `MAGIC_JSON` instead, and their body is JSON
`{"file", "save_id", "items": [[offset, length, "crc32c in hex"], ...]}`. Both are read (an
incremental save takes such files over as they are).

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
import sys
import uuid
from array import array
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import google_crc32c

from trainckpt.errors import CorruptCheckpointError
from trainckpt.storage.checksummed_file import crc32c_extend

MAGIC = b"TCKPTIR2"
MAGIC_JSON = b"TCKPTIR1"
SAVE_ID_PREFIX = "trainckpt-items-1:"
"""`.metadata`'s `storage_meta.save_id` starts with this when every shard has an item record."""

_FOOTER = struct.Struct("<Q8s")
_HEADER_LENGTH = struct.Struct("<I")
_MAX_HEADER = 64 * 1024  # a file name and a save id
_ROW_BYTES = 8 + 8 + 4  # an item's offset, length and CRC32C
_TAIL = 64 * 1024  # one read fetches the whole record of a shard with up to ~3,000 items
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
    """The record of shard `file` of save `save_id` holding `items` (offset, length, crc32c)."""
    header = json.dumps({"file": file, "save_id": save_id, "items": len(items)}).encode()
    columns = [_column(code, map(itemgetter(n), items)) for n, code in enumerate("QQI")]
    body = b"".join([_HEADER_LENGTH.pack(len(header)), header, *map(_on_disk, columns)])
    return body + _FOOTER.pack(len(body), MAGIC)


def _column(code: str, values: Any = ()) -> array[int]:
    """A column of the record: unsigned integers of `_SIZES[code]` bytes."""
    column = array(code, values)
    if column.itemsize != _SIZES[code]:
        raise RuntimeError(f"array type {code!r} is not {_SIZES[code]} bytes on this machine")
    return column


def _on_disk(column: array[int]) -> bytes:
    if _BIG_ENDIAN:
        column.byteswap()
    return column.tobytes()


_SIZES = {"Q": 8, "I": 4}
_BIG_ENDIAN = sys.byteorder == "big"


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
    if len(tail) < _FOOTER.size or tail[-len(MAGIC) :] not in (MAGIC, MAGIC_JSON):
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
    if tail[-len(MAGIC) :] == MAGIC_JSON:
        return _read_json(body, where)
    return _read_columns(body, where)


def _read_columns(body: bytes, where: str) -> ItemRecord:
    """The record of the layout `MAGIC` names (module docstring)."""
    if len(body) < _HEADER_LENGTH.size:
        raise _damaged(where, f"a record of {len(body)} bytes")
    (header_length,) = _HEADER_LENGTH.unpack_from(body)
    start = _HEADER_LENGTH.size + header_length
    if header_length > min(_MAX_HEADER, len(body) - _HEADER_LENGTH.size):
        raise _damaged(where, f"a header length of {header_length} bytes")
    try:
        header = json.loads(body[_HEADER_LENGTH.size : start])
        file, save_id, count = header["file"], header["save_id"], header["items"]
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise _damaged(where, f"{type(e).__name__}: {e}") from e
    if not isinstance(file, str) or not isinstance(save_id, str):
        raise _damaged(where, "no file name or save id")
    if type(count) is not int or len(body) - start != count * _ROW_BYTES:
        raise _damaged(where, f"an item count of {count!r:.40} for {len(body) - start} bytes")
    columns = []
    for code in "QQI":
        column, end = _column(code), start + count * _SIZES[code]
        column.frombytes(body[start:end])
        if _BIG_ENDIAN:
            column.byteswap()
        columns.append(column)
        start = end
    offsets, lengths, crcs = columns
    items = dict(zip(offsets, zip(lengths, crcs, strict=True), strict=True))
    return ItemRecord(file=file, save_id=save_id, items=items)


def _read_json(body: bytes, where: str) -> ItemRecord:
    """The record of the layout `MAGIC_JSON` names (module docstring)."""
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
