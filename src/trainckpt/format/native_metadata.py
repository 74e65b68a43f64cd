"""trainckpt's own description of a DCP folder (`.metadata.trainckpt`): the same `Metadata` as
DCP's pickled `.metadata`, in a form that is parsed without unpickling anything.

Rank 0 writes it beside `.metadata` (which stays, so DCP, OLMo-core and torchtitan still load
the folder); trainckpt's loader reads it instead of `.metadata` when it is there and, where the
checkpoint has a manifest, listed in it with the size and CRC32C read. Layout
(`docs/design.md`, "Layout"):

    b"TCKPTMD1"                      8 bytes, magic and version
    header length                    8 bytes, unsigned little-endian
    header                           UTF-8 JSON object, at most MAX_HEADER_BYTES
    chunk table                      little-endian int64s, `header["ints"]` of them

The header holds one record per state entry (tensors: name, dtype, flags, size and chunk
count; byte values: name and place), the shard file names, DCP's planner data and storage
meta. The chunk table holds, for every chunk of every tensor in header order, its offsets and
sizes (`ndim` each), its index hint + 1 (0: none), its file's position in `files`, and its
offset and length in that file: all non-negative, checked in one pass.

Parsing never runs code: the header is plain JSON, checked field by field against the types
above; dtypes come from a fixed table; the table is read as integers. A crafted file is
refused with `CorruptCheckpointError` naming it. Memory stays proportional to the file (which
`records.dcp_metadata_bound` bounds): the header's containers are counted before it is
parsed, and every count is checked against the bytes that carry it.

`decode` returns a `NativeMetadata`: DCP's `Metadata`, with the storage keys (one object per
stored piece) built only when `storage_data` is first read, and each single-piece entry's stored
piece by name (`pieces`), which is all a load of whole entries needs (`core/dcp.py`).

Called on: rank 0 at the end of a save (`encode`); any rank that plans a load (`decode`).
"""

from __future__ import annotations

import itertools
import json
import sys
import uuid
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from trainckpt.errors import CorruptCheckpointError

MAGIC = b"TCKPTMD1"
VERSION = 1
MAX_HEADER_BYTES = 256 * 1024 * 1024
"""Largest header read: ~200 bytes per state entry, so about a million entries per folder."""
BYTES_PER_CONTAINER = 8
"""The header may hold at most one JSON list or object per this many of its bytes: every
record of a real header is longer, and it bounds what a crafted `[[[],[],...` can cost in
memory (each container is an object of ~60 bytes)."""
MAX_NDIM = 64
_PREFIX = len(MAGIC) + 8
_PER_CHUNK = 4  # index hint, file, offset, length (plus 2 * ndim)

_DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
"""Every dtype torch has, by name: the only way a name from the file becomes a dtype."""


# -- writing (rank 0) --------------------------------------------------------------------------


def encode(md: Metadata) -> bytes | None:
    """`md` in this format, or None when it holds something the format does not describe
    (another layout or memory format, transforms, chunks without exactly one stored piece,
    unusual planner data): then only `.metadata` is written, and loads unpickle it safely."""
    parts = encode_parts(md)
    return None if parts is None else parts.with_storage_meta(md.storage_meta)


@dataclass(frozen=True)
class Parts:
    """`md` in this format but for its storage meta (the save's id and folder, which change
    with every save while the rest may not): the bytes around it. `format/metadata_files.py`
    keeps them to encode the next save of the same layout without walking every entry."""

    head_before: bytes
    head_after: bytes
    table: bytes

    def with_storage_meta(self, meta: StorageMeta | None) -> bytes | None:
        """The whole record with `meta` in its place; None if the format cannot hold `meta`."""
        try:
            middle = _json(_encode_storage_meta(meta))
        except _Unsupported:
            return None
        head = self.head_before + middle + self.head_after
        if len(head) > MAX_HEADER_BYTES:
            return None
        return MAGIC + len(head).to_bytes(8, "little") + head + self.table


def encode_parts(md: Metadata) -> Parts | None:
    """`md` in this format, split around its storage meta (`Parts`); None as for `encode`."""
    try:
        return _encode(md)
    except _Unsupported:
        return None


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class _Unsupported(Exception):
    pass


def _need(ok: bool) -> None:
    if not ok:
        raise _Unsupported


def _encode(md: Metadata) -> Parts:
    storage = md.storage_data
    _need(isinstance(storage, dict))
    files: dict[str, int] = {}
    by_key: dict[tuple[str, tuple[int, ...] | None], tuple[MetadataIndex, _StorageInfo]] = {}
    for key, info in storage.items():
        _need(type(key) is MetadataIndex and type(info) is _StorageInfo)
        _need(info.transform_descriptors is None and isinstance(info.relative_path, str))
        offset = None if key.offset is None else tuple(key.offset)
        by_key[(key.fqn, offset)] = (key, info)
        files.setdefault(info.relative_path, len(files))
    tensors: list[list[Any]] = []
    byte_values: list[list[Any]] = []
    ints: list[int] = []
    for fqn, entry in md.state_dict_metadata.items():
        _need(isinstance(fqn, str))
        if type(entry) is BytesStorageMetadata:
            key, info = _pop(by_key, (fqn, None))
            byte_values.append(
                [fqn, _hint(key), files[info.relative_path], info.offset, info.length]
            )
            continue
        if type(entry) is not TensorStorageMetadata or not isinstance(entry, TensorStorageMetadata):
            raise _Unsupported
        p = entry.properties
        _need(p.layout == torch.strided and p.memory_format == torch.contiguous_format)
        size = list(entry.size)
        tensors.append(
            [
                fqn,
                str(p.dtype).removeprefix("torch."),
                bool(p.requires_grad),
                bool(p.pin_memory),
                size,
                len(entry.chunks),
            ]
        )
        for chunk in entry.chunks:
            _need(len(chunk.offsets) == len(size) == len(chunk.sizes))
            key, info = _pop(by_key, (fqn, tuple(chunk.offsets)))
            ints += chunk.offsets
            ints += chunk.sizes
            ints += (_hint(key), files[info.relative_path], info.offset, info.length)
    _need(not by_key)  # every stored piece belongs to exactly one entry
    marker = f"trainckpt-storage-meta-{uuid.uuid4().hex}"  # the place of the storage meta
    header = {
        "version": VERSION,
        "dcp_version": md.version,
        "storage_meta": marker,
        "planner_data": _encode_planner_data(md.planner_data),
        "files": list(files),
        "tensors": tensors,
        "bytes": byte_values,
        "ints": len(ints),
    }
    head = _json(header)
    _need(len(head) <= MAX_HEADER_BYTES)
    before, found, after = head.partition(_json(marker))
    _need(bool(found) and _json(marker) not in after)
    table = array("q", ints)
    if sys.byteorder == "big":
        table.byteswap()
    return Parts(before, after, table.tobytes())


def _pop(by_key: dict[Any, tuple[MetadataIndex, _StorageInfo]], key: Any) -> Any:
    """The stored piece of an entry or chunk, taken out of `by_key`; none is unsupported."""
    found = by_key.pop(key, None)
    _need(found is not None)
    return found


def _hint(key: MetadataIndex) -> int:
    return 0 if key.index is None else key.index + 1


def _encode_storage_meta(meta: StorageMeta | None) -> dict[str, Any] | None:
    if meta is None:
        return None
    _need(type(meta) is StorageMeta)
    cid = meta.checkpoint_id
    _need(cid is None or isinstance(cid, str | PurePosixPath))
    _need(all(isinstance(m, str) for m in meta.modules))
    return {
        "checkpoint_id": None if cid is None else [type(cid).__name__ != "str", str(cid)],
        "save_id": meta.save_id,
        "load_id": meta.load_id,
        "modules": list(meta.modules),
    }


def _encode_planner_data(data: Any) -> list[list[Any]] | None:
    if data is None:
        return None
    _need(isinstance(data, dict))
    out = []
    for fqn, path in data.items():
        _need(isinstance(fqn, str) and isinstance(path, tuple))
        _need(all(type(p) in (str, int) for p in path))
        out.append([fqn, list(path)])
    return out


# -- reading (any rank) ------------------------------------------------------------------------


class NativeMetadata(Metadata):
    """The `Metadata` decoded from a record, with its `storage_data` (a key object and a dict
    entry per stored piece, 60,000 for a 16,000-entry state) built on first use, and `pieces`:
    the stored piece of each entry that has exactly one (byte values, tensors of one chunk) by
    name, all that a load of whole entries needs (`shard_reader`). Its `planner_data` (checked
    when decoded) is likewise built on first use: DCP's load of a whole state never reads it.
    Copies (`copy.copy`) share what is built; pickling, `dataclasses.replace` and equality
    see a plain `Metadata`."""

    def __init__(
        self,
        state_dict_metadata: dict[str, Any],
        planner_data: Any = None,
        storage_data: Any = None,
        storage_meta: StorageMeta | None = None,
        version: str | None = None,
        *,
        pieces: dict[str, _StorageInfo] | None = None,
        build: Callable[[], dict[MetadataIndex, _StorageInfo]] | None = None,
        build_planner: Callable[[], dict[str, tuple[str | int, ...]]] | None = None,
    ) -> None:
        self._lazy: list[Any] = [storage_data, build]  # shared by copies
        self._lazy_planner: list[Any] = [planner_data, build_planner]
        self.pieces = pieces
        super().__init__(state_dict_metadata, planner_data, storage_data, storage_meta, version)

    @property  # type: ignore[override]
    def storage_data(self) -> Any:
        lazy = self._lazy
        if lazy[1] is not None:
            lazy[0], lazy[1] = lazy[1](), None
        return lazy[0]

    @storage_data.setter
    def storage_data(self, value: Any) -> None:
        if value is not None or self._lazy[1] is None:
            self._lazy = [value, None]

    @property  # type: ignore[override]
    def planner_data(self) -> Any:
        lazy = self._lazy_planner
        if lazy[1] is not None:
            lazy[0], lazy[1] = lazy[1](), None
        return lazy[0]

    @planner_data.setter
    def planner_data(self, value: Any) -> None:
        if value is not None or self._lazy_planner[1] is None:
            self._lazy_planner = [value, None]

    @property
    def planner_built(self) -> bool:
        """Whether `planner_data` exists already; if not, it is a dict (never None)."""
        return self._lazy_planner[1] is None

    @property
    def storage_built(self) -> bool:
        """Whether `storage_data` exists already (reading it would cost nothing)."""
        return self._lazy[1] is None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Metadata):
            return NotImplemented
        return _fields(self) == _fields(other)

    __hash__ = None  # type: ignore[assignment]  # as a dataclass with eq and not frozen

    def __copy__(self) -> NativeMetadata:
        other = NativeMetadata.__new__(NativeMetadata)
        other.__dict__.update(self.__dict__)
        return other

    def __reduce__(self) -> Any:
        return (Metadata, _fields(self))


def _fields(md: Metadata) -> tuple[Any, ...]:
    return (md.state_dict_metadata, md.planner_data, md.storage_data, md.storage_meta, md.version)


_PATH_PART_TYPES = {str, int}


def decode(data: bytes, where: str) -> Metadata:
    """The `Metadata` that `data` (the bytes of `where`) describes; `CorruptCheckpointError`
    naming `where` and the field when anything in it is out of place."""
    return _Decoder(data, where).metadata()


class _Decoder:
    def __init__(self, data: bytes, where: str) -> None:
        self.data = data
        self.where = where

    def fail(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"'{self.where}' is not a valid trainckpt metadata record: {what}. It is never "
            "needed to load: delete it to load through DCP's .metadata, or restore the "
            "checkpoint from a copy"
        )

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            raise self.fail(what)

    def metadata(self) -> Metadata:
        data = self.data
        self.check(data[: len(MAGIC)] == MAGIC, "it does not start with the trainckpt magic")
        self.check(len(data) >= _PREFIX, "it is truncated")
        head_len = int.from_bytes(data[len(MAGIC) : _PREFIX], "little")
        self.check(
            head_len <= min(MAX_HEADER_BYTES, len(data) - _PREFIX),
            f"its header length {head_len} exceeds the file or {MAX_HEADER_BYTES} bytes",
        )
        head = data[_PREFIX : _PREFIX + head_len]
        containers = head.count(b"[") + head.count(b"{")
        self.check(
            containers * BYTES_PER_CONTAINER <= max(head_len, 64),
            f"its header has {containers} lists and objects in {head_len} bytes",
        )
        try:
            header = json.loads(head)
        except (ValueError, RecursionError) as e:
            raise self.fail(f"its header is not JSON ({type(e).__name__})") from None
        h = self.fields(
            header,
            "header",
            (
                "version",
                "dcp_version",
                "storage_meta",
                "planner_data",
                "files",
                "tensors",
                "bytes",
                "ints",
            ),
        )
        self.check(h["version"] == VERSION, f"version {h['version']!r} is not {VERSION}")
        table_bytes = len(data) - _PREFIX - head_len
        count = h["ints"]
        self.check(
            type(count) is int and count * 8 == table_bytes,
            f"'ints' ({count!r}) does not match the {table_bytes} bytes of its chunk table",
        )
        table = array("q")
        table.frombytes(data[_PREFIX + head_len :])
        if sys.byteorder == "big":
            table.byteswap()
        self.check(not table or min(table) >= 0, "its chunk table holds a negative number")
        files = self.strings(h["files"], "files")
        entries: dict[str, Any] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        ints = table.tolist()
        # The columns are checked at once (`_fast_*`); a record out of place is then found,
        # and named, by the record-by-record checks, which also build what the fast ones do.
        # The fast ones leave the storage keys to be built on first use (`NativeMetadata`).
        pieces: dict[str, _StorageInfo] | None = {}
        later: list[Callable[[], Iterable[tuple[MetadataIndex, _StorageInfo]]]] = []
        if not _fast_tensors(h["tensors"], ints, files, entries, pieces, later):
            self.tensors(h["tensors"], ints, files, entries, storage)
            pieces = None
        if not _fast_byte_values(h["bytes"], files, entries, pieces, later):
            self.byte_values(h["bytes"], files, entries, storage)
            pieces = None
        build_planner = _fast_planner_data(h["planner_data"])
        planner_data = None
        if build_planner is None:
            planner_data = self.planner_data(h["planner_data"])
        storage_meta = self.storage_meta(h["storage_meta"])
        version = self.optional_str(h["dcp_version"], "dcp_version")
        if pieces is None:  # built record by record: already whole
            for build in later:
                storage.update(build())
            return NativeMetadata(
                entries, planner_data, storage, storage_meta, version, build_planner=build_planner
            )

        def build_storage() -> dict[MetadataIndex, _StorageInfo]:
            built: dict[MetadataIndex, _StorageInfo] = {}
            for build in later:
                built.update(build())
            return built

        return NativeMetadata(
            entries,
            planner_data,
            None,
            storage_meta,
            version,
            pieces=pieces,
            build=build_storage,
            build_planner=build_planner,
        )

    def fields(self, obj: Any, what: str, names: Sequence[str]) -> dict[str, Any]:
        self.check(
            isinstance(obj, dict) and sorted(obj) == sorted(names),
            f"'{what}' does not have exactly the fields {sorted(names)}",
        )
        return obj  # type: ignore[no-any-return]

    def strings(self, obj: Any, what: str) -> list[str]:
        self.check(
            isinstance(obj, list) and all(isinstance(s, str) for s in obj),
            f"'{what}' is not a list of strings",
        )
        return obj  # type: ignore[no-any-return]

    def optional_str(self, obj: Any, what: str) -> str | None:
        self.check(obj is None or isinstance(obj, str), f"'{what}' is not a string or null")
        return obj  # type: ignore[no-any-return]

    def tensors(
        self,
        records: Any,
        ints: list[int],
        files: list[str],
        entries: dict[str, Any],
        storage: dict[MetadataIndex, _StorageInfo],
    ) -> None:
        self.check(isinstance(records, list), "'tensors' is not a list")
        pos = 0
        for rec in records:
            # Messages are formatted only on failure: tens of thousands of records each.
            if not (isinstance(rec, list) and len(rec) == 6):
                raise self.fail("a tensor record is not 6 fields")
            fqn, dtype_name, grad, pinned, size, chunk_count = rec
            if not (isinstance(fqn, str) and fqn not in entries):
                raise self.fail(f"tensor name {fqn!r}")
            dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
            if dtype is None:
                raise self.fail(f"tensor '{fqn}': dtype {dtype_name!r} is unknown")
            if not (type(grad) is bool and type(pinned) is bool):
                raise self.fail(f"tensor '{fqn}': flags")
            if not (
                isinstance(size, list)
                and len(size) <= MAX_NDIM
                and all(type(n) is int and n >= 0 for n in size)
            ):
                raise self.fail(f"tensor '{fqn}': size {size!r}")
            ndim = len(size)
            width = 2 * ndim + _PER_CHUNK
            if not (
                type(chunk_count) is int
                and 0 <= chunk_count
                and pos + chunk_count * width <= len(ints)
            ):
                raise self.fail(f"tensor '{fqn}': {chunk_count!r} chunks overrun the chunk table")
            chunks = []
            for _ in range(chunk_count):
                offsets = torch.Size(ints[pos : pos + ndim])
                sizes = torch.Size(ints[pos + ndim : pos + 2 * ndim])
                hint, file, offset, length = ints[pos + 2 * ndim : pos + width]
                pos += width
                if file >= len(files):
                    raise self.fail(f"tensor '{fqn}': file {file} is not listed")
                chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=sizes))
                key = MetadataIndex(fqn, offsets, hint - 1 if hint else None)
                storage[key] = _StorageInfo(files[file], offset, length)
            props = TensorProperties(dtype=dtype, requires_grad=grad, pin_memory=pinned)
            entries[fqn] = TensorStorageMetadata(props, torch.Size(size), chunks)
        self.check(pos == len(ints), "the chunk table is longer than its tensors' chunks")

    def byte_values(
        self,
        records: Any,
        files: list[str],
        entries: dict[str, Any],
        storage: dict[MetadataIndex, _StorageInfo],
    ) -> None:
        self.check(isinstance(records, list), "'bytes' is not a list")
        for rec in records:
            if not (isinstance(rec, list) and len(rec) == 5):
                raise self.fail("a bytes record is not 5 fields")
            fqn, hint, file, offset, length = rec
            if not (isinstance(fqn, str) and fqn not in entries):
                raise self.fail(f"bytes name {fqn!r}")
            if not (
                type(hint) is int
                and type(file) is int
                and type(offset) is int
                and type(length) is int
                and 0 <= file < len(files)
                and min(hint, offset, length) >= 0
            ):
                raise self.fail(f"bytes value '{fqn}': place {rec[1:]!r}")
            entries[fqn] = BytesStorageMetadata()
            storage[MetadataIndex(fqn, None, hint - 1 if hint else None)] = _StorageInfo(
                files[file], offset, length
            )

    def planner_data(self, obj: Any) -> dict[str, tuple[str | int, ...]] | None:
        if obj is None:
            return None
        self.check(isinstance(obj, list), "'planner_data' is not a list")
        out: dict[str, tuple[str | int, ...]] = {}
        for rec in obj:
            ok = isinstance(rec, list) and len(rec) == 2 and isinstance(rec[0], str)
            ok = ok and isinstance(rec[1], list) and set(map(type, rec[1])) <= _PATH_PART_TYPES
            if not ok:
                raise self.fail(f"a 'planner_data' record is not [name, [str|int...]]: {rec!r:.80}")
            out[rec[0]] = tuple(rec[1])
        return out

    def storage_meta(self, obj: Any) -> StorageMeta | None:
        if obj is None:
            return None
        m = self.fields(obj, "storage_meta", ("checkpoint_id", "save_id", "load_id", "modules"))
        cid = m["checkpoint_id"]
        ok = cid is None or (
            isinstance(cid, list)
            and len(cid) == 2
            and type(cid[0]) is bool
            and isinstance(cid[1], str)
        )
        self.check(ok, "'storage_meta.checkpoint_id' is not null or [is_path, text]")
        checkpoint_id: Any = None if cid is None else cid[1]
        if cid is not None and cid[0]:  # a path is what DCP's own writer records
            checkpoint_id = Path(cid[1])
        return StorageMeta(
            checkpoint_id=checkpoint_id,
            save_id=self.optional_str(m["save_id"], "storage_meta.save_id"),
            load_id=self.optional_str(m["load_id"], "storage_meta.load_id"),
            modules=self.strings(m["modules"], "storage_meta.modules"),
        )


# -- the same checks, column by column -----------------------------------------------------------
#
# A real record has tens of thousands of entries; checking each field of each one in Python was
# most of a load's bookkeeping (`docs/scale.md`). These check each column with one call that
# runs in C (`set(map(type, ...))`, `min`, `max`), then build the objects with no checks left.
# They accept only what the record-by-record checks accept (they are stricter where it is
# simpler: any doubt returns False or None, and the `_Decoder` checks then run, and name what
# is wrong). Equal sizes share one `torch.Size` (immutable).


def _types(column: Any) -> set[type]:
    return set(map(type, column))


def _ints_ok(column: Sequence[Any]) -> bool:
    """Every value an int (not a bool) >= 0."""
    return not column or (_types(column) == {int} and min(column) >= 0)


def _columns(records: Any, width: int) -> list[tuple[Any, ...]] | None:
    """`records` (a list of lists of `width` fields) as `width` columns; None if it is not."""
    if type(records) is not list:
        return None
    if not records:
        return [()] * width
    if _types(records) != {list} or set(map(len, records)) != {width}:
        return None
    return list(zip(*records, strict=True))


def _new_names(names: tuple[Any, ...], entries: dict[str, Any]) -> bool:
    """Whether `names` are strings, distinct, and none of them in `entries` yet."""
    return (
        (not names or _types(names) == {str})
        and len(set(names)) == len(names)
        and entries.keys().isdisjoint(names)
    )


def _fast_tensors(
    records: Any,
    ints: list[int],
    files: list[str],
    entries: dict[str, Any],
    pieces: dict[str, _StorageInfo] | None,
    later: list[Callable[[], Iterable[tuple[MetadataIndex, _StorageInfo]]]],
) -> bool:
    """`_Decoder.tensors`, column by column; False (nothing added) where in doubt. The stored
    piece of each one-chunk tensor goes to `pieces`; the storage keys are built by a function
    appended to `later`."""
    columns = _columns(records, 6)
    if columns is None:
        return False
    fqns, dtype_names, grads, pins, sizes, counts = columns
    if not _new_names(fqns, entries):
        return False
    if dtype_names and _types(dtype_names) != {str}:
        return False
    dtypes = [_DTYPES.get(name) for name in dtype_names]
    if any(d is None for d in dtypes) or not (_types(grads) | _types(pins)) <= {bool}:
        return False
    if sizes and (_types(sizes) != {list} or max(map(len, sizes)) > MAX_NDIM):
        return False
    if not _ints_ok([n for size in sizes for n in size]) or not _ints_ok(counts):
        return False
    widths = [2 * len(size) + _PER_CHUNK for size in sizes]
    if sum(map(int.__mul__, counts, widths)) != len(ints):
        return False
    shapes: dict[tuple[int, ...], torch.Size] = {}
    props: dict[tuple[torch.dtype, bool, bool], TensorProperties] = {}
    built: dict[str, TensorStorageMetadata] = {}
    keys: list[tuple[str, torch.Size, int | None]] = []
    infos: list[_StorageInfo] = []
    single: dict[str, _StorageInfo] = {}
    pos = 0
    for fqn, dtype, grad, pinned, size, count, width in zip(
        fqns, dtypes, grads, pins, sizes, counts, widths, strict=True
    ):
        ndim = len(size)
        chunks = []
        for _ in range(count):
            row = ints[pos : pos + width]
            pos += width
            offsets = tuple(row[:ndim])
            lengths = tuple(row[ndim : 2 * ndim])
            hint, file, offset, length = row[2 * ndim :]
            if file >= len(files):
                return False
            o = shapes.get(offsets) or shapes.setdefault(offsets, torch.Size(offsets))
            n = shapes.get(lengths) or shapes.setdefault(lengths, torch.Size(lengths))
            chunks.append(ChunkStorageMetadata(offsets=o, sizes=n))
            keys.append((fqn, o, hint - 1 if hint else None))
            info = _StorageInfo(files[file], offset, length)
            infos.append(info)
            if count == 1:
                single[fqn] = info
        key = (dtype, grad, pinned)
        p = props.get(key)
        if p is None:
            p = props[key] = TensorProperties(dtype=dtype, requires_grad=grad, pin_memory=pinned)
        whole = tuple(size)
        shape = shapes.get(whole) or shapes.setdefault(whole, torch.Size(whole))
        built[fqn] = TensorStorageMetadata(p, shape, chunks)
    entries.update(built)
    if pieces is not None:
        pieces.update(single)

    def storage() -> Iterable[tuple[MetadataIndex, _StorageInfo]]:
        return zip(itertools.starmap(MetadataIndex, keys), infos, strict=True)

    later.append(storage)
    return True


def _fast_byte_values(
    records: Any,
    files: list[str],
    entries: dict[str, Any],
    pieces: dict[str, _StorageInfo] | None,
    later: list[Callable[[], Iterable[tuple[MetadataIndex, _StorageInfo]]]],
) -> bool:
    """`_Decoder.byte_values`, column by column; False (nothing added) where in doubt. Each
    value's stored piece goes to `pieces`; the storage keys are built by a function appended
    to `later`. Every byte value's entry is one shared `BytesStorageMetadata` (it has no
    fields: all are equal)."""
    columns = _columns(records, 5)
    if columns is None:
        return False
    fqns, hints, file_ids, offsets, lengths = columns
    if not _new_names(fqns, entries):
        return False
    if not all(map(_ints_ok, (hints, file_ids, offsets, lengths))):
        return False
    if file_ids and max(file_ids) >= len(files):
        return False
    infos = list(map(_StorageInfo, [files[f] for f in file_ids], offsets, lengths))
    if pieces is not None:
        pieces.update(zip(fqns, infos, strict=True))
    entries.update(zip(fqns, repeat(_BYTES_ENTRY)))

    def storage() -> Iterable[tuple[MetadataIndex, _StorageInfo]]:
        indices = [h - 1 if h else None for h in hints]
        return zip(map(MetadataIndex, fqns, repeat(None), indices), infos, strict=True)

    later.append(storage)
    return True


_BYTES_ENTRY = BytesStorageMetadata()


def _fast_planner_data(obj: Any) -> Callable[[], dict[str, tuple[str | int, ...]]] | None:
    """`_Decoder.planner_data`, column by column: checked now, and a function that builds it
    (on first use: `NativeMetadata`); None where in doubt (or null)."""
    columns = _columns(obj, 2)
    if columns is None:
        return None
    fqns, paths = columns
    if fqns and _types(fqns) != {str}:
        return None
    if paths and _types(paths) != {list}:
        return None
    if not _types(itertools.chain.from_iterable(paths)) <= _PATH_PART_TYPES:
        return None

    def build() -> dict[str, tuple[str | int, ...]]:
        return dict(zip(fqns, map(tuple, paths), strict=True))

    return build
