"""trainckpt's own description of a DCP folder (`.metadata.trainckpt`): the same `Metadata` as
DCP's pickled `.metadata`, in a form that is parsed without unpickling anything.

Rank 0 writes it beside `.metadata` (which stays, so DCP, OLMo-core and torchtitan still load
the folder); trainckpt's loader reads it instead of `.metadata` when it is there and, where the
checkpoint has a manifest, listed in it with the size and CRC32C read. Layout
(`docs/design.md`, "Layout"):

    b"TCKPTMD1"                      8 bytes, magic
    header length                    8 bytes, unsigned little-endian
    header                           UTF-8 JSON object, at most MAX_HEADER_BYTES
    chunk table                      little-endian int64s, `header["ints"]` of them
    planner section                  `header["planner"]` bytes (none if null): DCP's planner
                                     data, JSON [[key, ...], [[path element, ...], ...]]

The header holds one record per state entry (tensors: name, dtype, flags, size and chunk
count; byte values: name and place), the shard file names and DCP's storage meta. DCP's
planner data (a path per DCP entry: most of what a JSON parse of the record would make, and
never read by a load of a whole state) is a section of its own after the table, parsed and
checked only when `planner_data` is first read (`docs/scale.md`, "The planner data read on
first use"); it is bounded like the header. Records of version 1 (trainckpt before that) have
it in the header as `[[key, [path element, ...]], ...]` and no section; they are still
decoded. The chunk table holds, for every chunk of every tensor in header order, its offsets and
sizes (`ndim` each), its index hint + 1 (0: none), its file's position in `files`, and its
offset and length in that file: all non-negative, checked in one pass.

Parsing never runs code: the header is plain JSON, checked field by field against the types
above; dtypes come from a fixed table; the table is read as integers. A crafted file is
refused with `CorruptCheckpointError` naming it. Memory stays proportional to the file (which
`records.dcp_metadata_bound` bounds): the header's containers are counted before it is
parsed, and every count is checked against the bytes that carry it.

`decode` returns a `NativeMetadata`: DCP's `Metadata`, whose `storage_data` is a mapping that
finds each stored piece in the chunk table (`_Storage`: no key object per piece), and each
single-piece entry's stored piece by name (`pieces`), which is all a load of whole entries needs
(`core/dcp.py`). A tensor of more than `LAZY_CHUNKS` chunks (one sharded over many ranks) keeps
them in the table, a view of the file's bytes (`LazyChunks`): a rank's load plan makes objects
only for the chunks that overlap its own (`read_items`), so the metadata of 2 million chunks is
read in a fraction of a second and a few MB beyond the file (`docs/scale.md`).

Called on: rank 0 at the end of a save (`encode`); any rank that plans a load (`decode`).
"""

from __future__ import annotations

import functools
import itertools
import json
import sys
import uuid
import warnings
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path, PurePosixPath
from types import ModuleType
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
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import (
    _create_read_item_for_tensor as _read_item_for_tensor,
)
from torch.distributed.checkpoint.resharding import (
    _shards_get_overlap_region_wrt_saved_tensor as _overlap_region,
)

from trainckpt.errors import CorruptCheckpointError

_built: ModuleType | None
try:  # the per-entry column steps in C (native_columns.c), where the install could build them
    from trainckpt.format import native_columns as _built
except ImportError:  # pragma: no cover - every install CI makes has a C compiler
    _built = None
compiled = _built  # what `decode` uses (tests set None to run the Python steps)

MAGIC = b"TCKPTMD1"
VERSION = 2
"""Version 2: planner data in its own section; 1: in the header (still read)."""
MAX_HEADER_BYTES = 256 * 1024 * 1024
"""Largest header (or planner section) read: ~200 bytes per state entry, so about a million
entries per folder."""
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
    planner: bytes = b""  # the planner section

    def with_storage_meta(self, meta: StorageMeta | None) -> bytes | None:
        """The whole record with `meta` in its place; None if the format cannot hold `meta`."""
        try:
            middle = _json(_encode_storage_meta(meta))
        except _Unsupported:
            return None
        head = self.head_before + middle + self.head_after
        if len(head) > MAX_HEADER_BYTES:
            return None
        return b"".join((MAGIC, len(head).to_bytes(8, "little"), head, self.table, self.planner))


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
    planner = _encode_planner_data(md.planner_data)
    _need(planner is None or len(planner) <= MAX_HEADER_BYTES)
    header = {
        "version": VERSION,
        "dcp_version": md.version,
        "storage_meta": marker,
        "planner": None if planner is None else len(planner),
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
    return Parts(before, after, table.tobytes(), planner or b"")


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


def _encode_planner_data(data: Any) -> bytes | None:
    """The planner section: `data` as two JSON lists, its keys and their paths (a tuple is
    written as a list; two arrays parse faster than an object), checked column by column first
    (no list made per entry)."""
    if data is None:
        return None
    _need(isinstance(data, dict) and all(isinstance(fqn, str) for fqn in data))
    _need(not data or _types(data.values()) == {tuple})
    _need(_types(itertools.chain.from_iterable(data.values())) <= _PATH_PART_TYPES)
    return _json([list(data), list(data.values())])


# -- reading (any rank) ------------------------------------------------------------------------


class NativeMetadata(Metadata):
    """The `Metadata` decoded from a record, with its `storage_data` (a mapping answered from
    the chunk table, `_Storage`) made on first use, and `pieces`:
    the stored piece of each entry that has exactly one (byte values, tensors of one chunk) by
    name, all that a load of whole entries needs (`shard_reader`). Its `planner_data` is
    likewise made on first use (and, from a version 2 record, parsed and checked then): DCP's
    load of a whole state never reads it. Copies (`copy.copy`) share what is built; pickling,
    `dataclasses.replace` and equality see a plain `Metadata`."""

    def __init__(
        self,
        state_dict_metadata: dict[str, Any],
        planner_data: Any = None,
        storage_data: Any = None,
        storage_meta: StorageMeta | None = None,
        version: str | None = None,
        *,
        pieces: dict[str, _StorageInfo] | None = None,
        build: Callable[[], Mapping[MetadataIndex, _StorageInfo]] | None = None,
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
        end = _PREFIX + head_len
        containers = data.count(b"[", _PREFIX, end) + data.count(b"{", _PREFIX, end)
        self.check(
            containers * BYTES_PER_CONTAINER <= max(head_len, 64),
            f"its header has {containers} lists and objects in {head_len} bytes",
        )
        try:
            # One copy of the header, as text, decoded from `data` in place: `json.loads` of a
            # slice copied it twice (the slice, then its text), tens of MB of fresh pages per
            # load at tens of thousands of entries (docs/scale.md, "Where the load's cost per
            # entry grows"). The record is written as ASCII JSON (`_json`).
            header = json.loads(str(memoryview(data)[_PREFIX:end], "utf-8"))
        except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
            raise self.fail(f"its header is not JSON ({type(e).__name__})") from None
        record_version = header.get("version") if isinstance(header, dict) else None
        v1 = type(record_version) is int and record_version == 1  # planner data in the header
        planner_field = "planner_data" if v1 else "planner"
        h = self.fields(
            header,
            "header",
            (
                "version",
                "dcp_version",
                "storage_meta",
                planner_field,
                "files",
                "tensors",
                "bytes",
                "ints",
            ),
        )
        self.check(
            type(record_version) is int and record_version in (1, VERSION),
            f"version {record_version!r} is not 1 or {VERSION}",
        )
        planner_len = 0 if v1 else h["planner"]
        self.check(
            planner_len is None or (type(planner_len) is int and planner_len >= 0),
            f"'planner' ({planner_len!r}) is not null or a length",
        )
        table_bytes = len(data) - _PREFIX - head_len - (planner_len or 0)
        count = h["ints"]
        self.check(
            type(count) is int and count * 8 == table_bytes,
            f"'ints' ({count!r}) and 'planner' ({planner_len!r}) do not match the "
            f"{len(data) - _PREFIX - head_len} bytes after its header",
        )
        table = _int64s(data, _PREFIX + head_len, count)
        self.check(
            _least(data, _PREFIX + head_len, table) >= 0, "its chunk table holds a negative number"
        )
        files = self.strings(h["files"], "files")
        entries: dict[str, Any] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        # The columns are checked at once (`_fast_*`); a record out of place is then found,
        # and named, by the record-by-record checks, which also build what the fast ones do.
        # The fast ones leave the storage keys to be looked up in the table (`_Storage`).
        pieces: dict[str, _StorageInfo] | None = {}
        parts: list[_StoragePart] = []
        start = _PREFIX + head_len
        raw_table = memoryview(data)[start : start + 8 * count]
        if not (
            _compiled_tensors(h["tensors"], raw_table, table, files, entries, pieces, parts)
            or _fast_tensors(h["tensors"], table, files, entries, pieces, parts)
        ):
            self.tensors(h["tensors"], table.tolist(), files, entries, storage)
            pieces = None
        if not (
            _compiled_byte_values(h["bytes"], files, entries, pieces, parts)
            or _fast_byte_values(h["bytes"], files, entries, pieces, parts)
        ):
            self.byte_values(h["bytes"], files, entries, storage)
            pieces = None
        planner_data = None
        build_planner: Callable[[], dict[str, tuple[str | int, ...]]] | None = None
        if v1:
            build_planner = _fast_planner_data(h["planner_data"])
            if build_planner is None:
                planner_data = self.planner_data(h["planner_data"])
        elif planner_len is not None:
            self.check(
                planner_len <= MAX_HEADER_BYTES,
                f"its planner section of {planner_len} bytes exceeds {MAX_HEADER_BYTES}",
            )
            start = _PREFIX + head_len + 8 * count
            build_planner = functools.partial(self.planner_section, start, start + planner_len)
        storage_meta = self.storage_meta(h["storage_meta"])
        version = self.optional_str(h["dcp_version"], "dcp_version")
        if pieces is None:  # built record by record: made whole
            for part in parts:
                storage.update(part.items())
            return NativeMetadata(
                entries, planner_data, storage, storage_meta, version, build_planner=build_planner
            )
        return NativeMetadata(
            entries,
            planner_data,
            None,
            storage_meta,
            version,
            pieces=pieces,
            build=lambda: _Storage(parts),
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

    def planner_section(self, start: int, end: int) -> dict[str, tuple[str | int, ...]]:
        """The planner data in `data[start:end]` (version 2), checked: made when
        `planner_data` is first read, so a malformed section is refused then, naming the
        file. A load that never reads it does not notice one, which changes nothing it loads;
        the manifest's CRC32C of the whole file, checked before the record is decoded where
        there is a manifest, covers it (`docs/design.md`, "Layout")."""
        data = self.data
        containers = data.count(b"[", start, end) + data.count(b"{", start, end)
        self.check(
            containers * BYTES_PER_CONTAINER <= max(end - start, 64),
            f"its planner section has {containers} lists and objects in {end - start} bytes",
        )
        try:
            obj = json.loads(str(memoryview(data)[start:end], "utf-8"))
        except (ValueError, RecursionError) as e:
            raise self.fail(f"its planner section is not JSON ({type(e).__name__})") from None
        self.check(
            type(obj) is list
            and len(obj) == 2
            and _types(obj) == {list}
            and len(obj[0]) == len(obj[1]),
            "its planner section is not two lists of equal length (keys, paths)",
        )
        keys, paths = obj
        self.check(not keys or _types(keys) == {str}, "a planner key is not a string")
        if (paths and _types(paths) != {list}) or not _types(
            itertools.chain.from_iterable(paths)
        ) <= _PATH_PART_TYPES:
            key, path = next(
                (k, p)
                for k, p in zip(keys, paths, strict=True)
                if type(p) is not list or not _types(p) <= _PATH_PART_TYPES
            )
            raise self.fail(f"the planner path of {key!r:.80} is not [str|int...]: {path!r:.80}")
        out = dict(zip(keys, map(tuple, paths), strict=True))
        self.check(len(out) == len(keys), "a planner key is there twice")
        return out

    def planner_data(self, obj: Any) -> dict[str, tuple[str | int, ...]] | None:
        """The planner data of a version 1 record (in its header)."""
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


def _int64s(data: bytes, start: int, count: int) -> torch.Tensor:
    """The `count` little-endian int64s of `data` from byte `start`, as a read-only view of
    `data` (no copy), not a Python list: a table of 2 million chunks is 16 million numbers."""
    if sys.byteorder == "big":  # pragma: no cover - no big-endian machine runs this
        swapped = array("q", data[start : start + 8 * count])
        swapped.byteswap()
        return torch.tensor(swapped.tolist(), dtype=torch.int64)
    if not count:
        return torch.zeros(0, dtype=torch.int64)
    with warnings.catch_warnings():  # it is never written to: `data` is immutable bytes
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        return torch.frombuffer(data, dtype=torch.int64, count=count, offset=start)


def _least(data: bytes, start: int, table: torch.Tensor) -> int:
    """The least number of `table` (the int64s of `data` from byte `start`; 0 if empty). A
    small table is read by Python's `min` over the bytes (no list made): torch splits a
    reduction of more than 32,768 numbers over its threads, which on a busy machine wait for
    a core longer than the reduction takes."""
    if not len(table):
        return 0
    if len(table) <= _SMALL_TABLE and sys.byteorder == "little":
        return min(memoryview(data)[start : start + 8 * len(table)].cast("q"))
    return int(table.min())


_SMALL_TABLE = 1 << 20


LAZY_CHUNKS = 64
"""A tensor with more chunks than this keeps them in the chunk table (`LazyChunks`): a rank
that loads its own shard of it needs only the few that overlap it (`read_items`)."""


class LazyChunks(Sequence[ChunkStorageMetadata]):
    """The chunks of one tensor (`TensorStorageMetadata.chunks`), as rows of the chunk table:
    a `ChunkStorageMetadata` is made for a chunk only when it is read (all of them, once,
    when the sequence is iterated or compared). Pickles as a plain list."""

    __slots__ = ("_built", "_layouts", "_ndim", "_rows")

    def __init__(self, rows: torch.Tensor, ndim: int, layouts: dict[Any, Any]) -> None:
        self._rows = rows  # count x (2 * ndim + _PER_CHUNK), checked by the decoder
        self._ndim = ndim
        self._built: list[ChunkStorageMetadata] | None = None
        self._layouts = layouts  # shared by the tensors of one record: `_overlapping`

    def __len__(self) -> int:
        return int(self._rows.shape[0])

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice) or self._built is not None:
            return self._all()[i]
        row = self._rows[i].tolist()  # IndexError past the end, as a list
        nd = self._ndim
        return ChunkStorageMetadata(torch.Size(row[:nd]), torch.Size(row[nd : 2 * nd]))

    def _all(self) -> list[ChunkStorageMetadata]:
        if self._built is None:
            nd = self._ndim
            shapes: dict[tuple[int, ...], torch.Size] = {}
            built = []
            for row in self._rows[:, : 2 * nd].tolist():
                o, n = tuple(row[:nd]), tuple(row[nd:])
                built.append(
                    ChunkStorageMetadata(
                        shapes.get(o) or shapes.setdefault(o, torch.Size(o)),
                        shapes.get(n) or shapes.setdefault(n, torch.Size(n)),
                    )
                )
            self._built = built
        return self._built

    def __iter__(self) -> Iterator[ChunkStorageMetadata]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, LazyChunks | list | tuple):
            return self._all() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a list

    def __repr__(self) -> str:
        return f"LazyChunks({len(self)} chunks)"

    def __reduce__(self) -> Any:
        return (list, (self._all(),))

    def read_items(self, fqn: str, local: Sequence[ChunkStorageMetadata]) -> list[ReadItem] | None:
        """DCP's read items for loading the `local` chunks of `fqn` from these chunks
        (`create_read_items_for_chunk_list`: the same items, in the same order), with the
        chunks that overlap each local one found column by column; None when `local` does
        not have this tensor's number of dimensions (DCP's own search then runs)."""
        count, nd = len(self), self._ndim
        if not local or not count:
            return []
        if any(len(c.offsets) != nd or len(c.sizes) != nd for c in local):
            return None
        items: list[ReadItem] = []
        for li, lc, found in self._overlapping(local):
            dest = MetadataIndex(fqn, lc.offsets, li)
            for i in found:
                saved = self[i]
                region = _overlap_region(saved_shard=saved, current_shard=lc)
                items.append(
                    _read_item_for_tensor(
                        dest_index=dest,
                        dest_offsets=[r[2] for r in region],
                        storage_index=MetadataIndex(fqn, saved.offsets, i),
                        storage_offsets=[r[1] for r in region],
                        lengths=[r[3] for r in region],
                    )
                )
        return items

    def _overlapping(
        self, local: Sequence[ChunkStorageMetadata]
    ) -> list[tuple[int, ChunkStorageMetadata, list[int]]]:
        """For each of the `local` chunks, in DCP's order: its position, itself, and the
        positions of the chunks that overlap it, in DCP's order. Tensors sharded alike (most
        of a model's) have equal chunk offsets and sizes: the answer for one is kept and
        reused for the next whose columns are equal (one comparison, not a search)."""
        nd = self._ndim
        key = (len(self), nd, tuple((tuple(c.offsets), tuple(c.sizes)) for c in local))
        box = self._rows[:, : 2 * nd]
        known = self._layouts.setdefault(key, [])
        for other, answer in known:
            if torch.equal(box, other):
                return [(li, local[li], found) for li, found in answer]
        answer = self._search(local)
        if len(known) < _LAYOUTS_KEPT:
            known.append((box, answer))
        return [(li, local[li], found) for li, found in answer]

    def _search(self, local: Sequence[ChunkStorageMetadata]) -> list[tuple[int, list[int]]]:
        """`_overlapping`, column by column (DCP's sweep, `create_read_items_for_chunk_list`,
        visits every chunk in Python)."""
        count, nd = len(self), self._ndim
        rows = self._rows
        offsets, sizes = rows[:, :nd], rows[:, nd : 2 * nd]
        sweep = 0  # DCP's sweep dimension: it orders the items
        if nd > 1:
            ends = (offsets + sizes).amax(0).tolist()  # not max(0): 10 ms with its indices
            best = 0
            for d in range(nd):
                extent = max(ends[d], max(c.offsets[d] + c.sizes[d] for c in local))
                if extent > best:
                    best, sweep = extent, d
        order = sorted(range(len(local)), key=lambda i: local[i].offsets[sweep] if nd else 0)
        answer: list[tuple[int, list[int]]] = []
        for li in order:
            lc = local[li]
            if nd:
                # DCP's overlap test per dimension (`_check_shard_metadata_pair_overlap`):
                # local_offset < offset + size and offset < local_offset + local_size, the
                # first as local_offset - offset < size (no overflow: both are >= 0).
                hit = torch.ones(count, dtype=torch.bool)
                for d in range(nd):
                    lo, n = lc.offsets[d], lc.sizes[d]
                    hit &= (lo - offsets[:, d]) < sizes[:, d]
                    if lo + n <= _INT64_MAX:
                        hit &= offsets[:, d] < lo + n
                found = hit.nonzero().flatten().tolist()
                if not found:
                    answer.append((li, found))
                    continue
                # DCP visits them by end along the sweep dimension, then by index
                ends_at = (offsets[found, sweep] + sizes[found, sweep]).tolist()
                found = [i for _, i in sorted(zip(ends_at, found, strict=True))]
            else:
                found = list(range(count))
            answer.append((li, found))
        return answer


_INT64_MAX = 2**63 - 1
_LAYOUTS_KEPT = 4
"""Distinct chunk layouts kept per (chunk count, ndim, local chunks) for reuse."""


def read_items(
    fqn: str, saved: Any, local: Sequence[ChunkStorageMetadata]
) -> list[ReadItem] | None:
    """The read items that load the `local` chunks of tensor `fqn` (saved as `saved`, a
    `TensorStorageMetadata`), as DCP's `create_read_items_for_chunk_list` plans them, when
    `saved` keeps its chunks in the chunk table (`LazyChunks`): only the overlapping chunks
    are made. None otherwise (DCP's own search then runs).

    Called on: every rank that plans a load (`core/dcp.py`), per tensor it resharding-loads."""
    chunks = getattr(saved, "chunks", None)
    if type(chunks) is not LazyChunks:
        return None
    return chunks.read_items(fqn, local)


class _StoragePart(Mapping[MetadataIndex, _StorageInfo]):
    """Part of `storage_data` (the tensors' chunks, or the byte values): looked up by key,
    its keys made only when it is iterated."""


class _ChunkTable(_StoragePart):
    """The stored piece of every chunk of every tensor, looked up in the chunk table: a key's
    index hint (DCP's planner sets it to the chunk's position) finds its row, checked against
    the key's offsets; other keys are found through the tensor's offsets (made on first
    need)."""

    def __init__(
        self,
        table: torch.Tensor,
        files: list[str],
        fqns: Sequence[str],
        counts: Sequence[int],
        ndims: Sequence[int],
        ints: list[int] | None,
    ) -> None:
        self._table = table
        self._ints = ints  # the table as Python ints, when the decoder made them
        self._files = files
        self._columns = (fqns, counts, ndims)
        self._placed: dict[str, tuple[int, int, int]] | None = None
        self._by_offsets: dict[str, dict[tuple[int, ...], int]] = {}
        self._count = sum(counts)

    @property
    def _places(self) -> dict[str, tuple[int, int, int]]:
        """Name -> (position of its first number, chunk count, ndim), made on first use."""
        if self._placed is None:
            fqns, counts, ndims = self._columns
            spans = (n * (2 * nd + _PER_CHUNK) for n, nd in zip(counts, ndims, strict=True))
            starts = itertools.accumulate(spans, initial=0)
            # `starts` has one more: the end
            placed = zip(fqns, starts, counts, ndims, strict=False)
            self._placed = {f: (at, n, nd) for f, at, n, nd in placed}
        return self._placed

    def __getitem__(self, key: Any) -> _StorageInfo:
        place = self._places.get(getattr(key, "fqn", None))  # type: ignore[arg-type]
        offset = getattr(key, "offset", None)
        if place is None or offset is None:
            raise KeyError(key)
        pos, count, nd = place
        if len(offset) != nd:
            raise KeyError(key)
        width = 2 * nd + _PER_CHUNK
        i = key.index
        if (
            type(i) is not int
            or not 0 <= i < count
            or self._numbers(pos + i * width, nd) != list(offset)
        ):
            i = self._find(key.fqn, pos, count, nd).get(tuple(offset))
            if i is None:
                raise KeyError(key)
        file, at, length = self._numbers(pos + i * width + 2 * nd + 1, 3)
        return _StorageInfo(self._files[file], at, length)

    def _numbers(self, start: int, n: int) -> list[int]:
        if self._ints is not None:
            return self._ints[start : start + n]
        return self._table[start : start + n].tolist()  # type: ignore[no-any-return]

    def _find(self, fqn: str, pos: int, count: int, nd: int) -> dict[tuple[int, ...], int]:
        found = self._by_offsets.get(fqn)
        if found is None:
            width = 2 * nd + _PER_CHUNK
            rows = self._table[pos : pos + count * width].view(count, width)[:, :nd].tolist()
            found = self._by_offsets[fqn] = {tuple(r): i for i, r in enumerate(rows)}
        return found

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, (pos, count, nd) in self._places.items():
            width = 2 * nd + _PER_CHUNK
            rows = self._table[pos : pos + count * width].view(count, width)
            offsets = rows[:, :nd].tolist()
            hints = rows[:, 2 * nd].tolist()
            for o, h in zip(offsets, hints, strict=True):
                yield MetadataIndex(fqn, torch.Size(o), h - 1 if h else None)

    def __len__(self) -> int:
        return self._count


class _ByteValues(_StoragePart):
    """The stored piece of every byte value (`pieces`), keyed by name."""

    def __init__(self, infos: dict[str, _StorageInfo], hints: Sequence[int]) -> None:
        self._infos = infos
        self._hints = hints  # in the order of `infos`

    def __getitem__(self, key: Any) -> _StorageInfo:
        if getattr(key, "offset", 0) is not None:
            raise KeyError(key)
        return self._infos[key.fqn]

    def __iter__(self) -> Iterator[MetadataIndex]:
        for fqn, h in zip(self._infos, self._hints, strict=True):
            yield MetadataIndex(fqn, None, h - 1 if h else None)

    def __len__(self) -> int:
        return len(self._infos)


class _Storage(Mapping[MetadataIndex, _StorageInfo]):
    """`storage_data` of a `NativeMetadata`: DCP's mapping of every stored piece's key to its
    place, answered from the decoded record without a key object per piece (2 million for a
    large sharded job); iterating it makes them. Pickles and compares as a dict."""

    def __init__(self, parts: list[_StoragePart]) -> None:
        self._parts = parts

    def __getitem__(self, key: Any) -> _StorageInfo:
        for part in self._parts:
            try:
                return part[key]
            except KeyError:
                continue
        raise KeyError(key)

    def __iter__(self) -> Iterator[MetadataIndex]:
        return itertools.chain.from_iterable(self._parts)

    def __len__(self) -> int:
        return sum(map(len, self._parts))

    def __repr__(self) -> str:
        return f"<storage_data of {len(self)} pieces>"

    def __reduce__(self) -> Any:
        return (dict, (dict(self.items()),))


def _add(
    entries: dict[str, Any],
    built: Any,
    pieces: dict[str, _StorageInfo] | None,
    single: dict[str, _StorageInfo],
    parts: list[_StoragePart],
    part: _StoragePart,
) -> bool:
    """Add what a column step made: the entries (a mapping or pairs), the stored piece of each
    single-piece one, and its part of `storage_data`. True."""
    entries.update(built)
    if pieces is not None:
        pieces.update(single)
    parts.append(part)
    return True


def _compiled_tensors(
    records: Any,
    raw_table: memoryview,
    table: torch.Tensor,
    files: list[str],
    entries: dict[str, Any],
    pieces: dict[str, _StorageInfo] | None,
    parts: list[_StoragePart],
) -> bool:
    """`_fast_tensors` in C (`native_columns.tensors`, reading the table's bytes in place), for
    tensors of at most `LAZY_CHUNKS` chunks each; False (nothing added) where not built or in
    doubt."""
    fast = compiled
    if fast is None or type(records) is not list or type(files) is not list:
        return False
    classes = (TensorProperties, ChunkStorageMetadata, TensorStorageMetadata, _StorageInfo)
    made = fast.tensors(
        records, raw_table, files, _DTYPES, entries, LAZY_CHUNKS, MAX_NDIM, (*classes, torch.Size)
    )
    if made is None:
        return False
    built, single, fqns, counts, ndims = made
    return _add(
        entries, built, pieces, single, parts, _ChunkTable(table, files, fqns, counts, ndims, None)
    )


def _compiled_byte_values(
    records: Any,
    files: list[str],
    entries: dict[str, Any],
    pieces: dict[str, _StorageInfo] | None,
    parts: list[_StoragePart],
) -> bool:
    """`_fast_byte_values` in C (`native_columns.byte_values`); False (nothing added) where
    not built or in doubt."""
    fast = compiled
    if fast is None or type(records) is not list or type(files) is not list:
        return False
    made = fast.byte_values(records, files, entries, _StorageInfo)
    if made is None:
        return False
    infos, hints = made
    built = zip(infos, repeat(_BYTES_ENTRY))
    return _add(entries, built, pieces, infos, parts, _ByteValues(infos, hints))


def _fast_tensors(
    records: Any,
    table: torch.Tensor,
    files: list[str],
    entries: dict[str, Any],
    pieces: dict[str, _StorageInfo] | None,
    parts: list[_StoragePart],
) -> bool:
    """`_Decoder.tensors`, column by column; False (nothing added) where in doubt. The stored
    piece of each one-chunk tensor goes to `pieces`; the chunks' pieces are looked up in the
    table (`_ChunkTable`, appended to `parts`). A tensor of more than `LAZY_CHUNKS` chunks
    keeps them there too (`LazyChunks`)."""
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
    ndims = list(map(len, sizes))
    widths = [2 * nd + _PER_CHUNK for nd in ndims]
    if sum(map(int.__mul__, counts, widths)) != len(table):
        return False
    # The chunks made now, as Python ints: from one list of the table when they are most of
    # it (many small tensors), else from a slice per tensor (a few among millions of chunks)
    ints: list[int] | None = None
    if max(counts, default=0) <= LAZY_CHUNKS or 2 * sum(
        n * w for n, w in zip(counts, widths, strict=True) if n <= LAZY_CHUNKS
    ) >= len(table):
        ints = table.tolist()
    nfiles = len(files)
    shapes: dict[tuple[int, ...], torch.Size] = {}
    kinds = {
        (d, g, p): TensorProperties(dtype=d, requires_grad=g, pin_memory=p)  # type: ignore[arg-type]
        for d, g, p in set(zip(dtypes, grads, pins, strict=True))
    }
    properties = list(map(kinds.__getitem__, zip(dtypes, grads, pins, strict=True)))
    built: dict[str, TensorStorageMetadata] = {}
    single: dict[str, _StorageInfo] = {}
    layouts: dict[Any, Any] = {}
    pos = 0
    for fqn, p, size, count, nd, width in zip(
        fqns, properties, sizes, counts, ndims, widths, strict=True
    ):
        span = count * width
        chunks: Sequence[ChunkStorageMetadata]
        if count == 1 and ints is not None:  # most entries of a one-rank state
            row = ints[pos : pos + width]
            file = row[-3]
            if file >= nfiles:
                return False
            offsets, lengths = tuple(row[:nd]), tuple(row[nd : 2 * nd])
            o = shapes.get(offsets) or shapes.setdefault(offsets, torch.Size(offsets))
            n = shapes.get(lengths) or shapes.setdefault(lengths, torch.Size(lengths))
            chunks = [ChunkStorageMetadata(o, n)]
            single[fqn] = _StorageInfo(files[file], row[-2], row[-1])
        elif count > LAZY_CHUNKS:
            rows = table[pos : pos + span].view(count, width)
            if int(rows[:, -3].max()) >= nfiles:  # each chunk's file
                return False
            chunks = LazyChunks(rows, nd, layouts)
        else:
            at, row_ints = pos, ints
            if row_ints is None:
                at, row_ints = 0, table[pos : pos + span].tolist()
            chunks = []
            for _ in range(count):
                row = row_ints[at : at + width]
                at += width
                offsets = tuple(row[:nd])
                lengths = tuple(row[nd : 2 * nd])
                file, offset, length = row[-3:]
                if file >= nfiles:
                    return False
                o = shapes.get(offsets) or shapes.setdefault(offsets, torch.Size(offsets))
                n = shapes.get(lengths) or shapes.setdefault(lengths, torch.Size(lengths))
                chunks.append(ChunkStorageMetadata(o, n))
                if count == 1:
                    single[fqn] = _StorageInfo(files[file], offset, length)
        pos += span
        whole = tuple(size)
        shape = shapes.get(whole) or shapes.setdefault(whole, torch.Size(whole))
        built[fqn] = TensorStorageMetadata(p, shape, chunks)  # type: ignore[arg-type]
    return _add(
        entries, built, pieces, single, parts, _ChunkTable(table, files, fqns, counts, ndims, ints)
    )


def _fast_byte_values(
    records: Any,
    files: list[str],
    entries: dict[str, Any],
    pieces: dict[str, _StorageInfo] | None,
    parts: list[_StoragePart],
) -> bool:
    """`_Decoder.byte_values`, column by column; False (nothing added) where in doubt. Each
    value's stored piece goes to `pieces` and to the part of `storage_data` appended to
    `parts`. Every byte value's entry is one shared `BytesStorageMetadata` (it has no
    fields: all are equal), and values stored at one place share one `_StorageInfo`: the
    writer stores equal small values once (a 64,000-entry optimizer's 176,000
    hyperparameters are a few dozen places), and the reader then checks each place once."""
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
    places = list(zip(file_ids, offsets, lengths, strict=True))
    shared = dict.fromkeys(places)
    for place in shared:
        f, offset, length = place
        shared[place] = _StorageInfo(files[f], offset, length)
    infos = dict(zip(fqns, map(shared.__getitem__, places), strict=True))
    built = zip(fqns, repeat(_BYTES_ENTRY))
    return _add(entries, built, pieces, infos, parts, _ByteValues(infos, hints))


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
