"""The bytes of a save's `.metadata` (DCP's pickle) and `.metadata.trainckpt` (`native_metadata`),
reused from the previous save of the same layout.

Both files describe every entry and every stored piece: for a state of thousands of entries,
encoding them was a third of a save whose plan was reused (`docs/scale.md`). When the plan was
reused (`core/plan_cache.py`), the entries' metadata is the very object of the earlier save,
and when every item also went to the same file, offset and length, the two files differ from
the earlier save's only in the storage meta: the save's id and folder. So the coordinator keeps
each file's bytes around the storage meta and puts the new one in its place:

- `.metadata`: the pickle is made with a unique marker string where the storage meta goes,
  with DCP's pickle protocol, and without its optional frames (a frame's length would no longer
  match). The marker string was the object at one memo index; the new storage meta is pickled
  without a memo (every object written out, none referenced) and then stored at that same
  index, so every reference after it still points where it did. The result is a standard
  pickle that `pickle.load` (plain DCP, OLMo-core, torchtitan) and the safe unpickler read.
- `.metadata.trainckpt`: `native_metadata.Parts`.

The layout key is every result's index and place, compared in full: a byte item of another
length, a moved offset, another file, another rank count (a new global plan, so another entries
object) each mean a fresh encode. Both paths give the same bytes for the same metadata.
Comparing every row costs one tuple per item; when the writer hands out the very result lists
of the kept layout (it does when every item landed where it did: `shard_writer._Files`), the
layout is known equal by identity and no row is built. The rows of a kept layout are made only
when a later save of the same entries first compares with it: never on a save that planned anew
(its entries object is new), where they were a tenth of the metadata's encoding.

Called on: the coordinator (rank 0), at the end of a save (`shard_writer.RecordingWriter`).
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.storage import WriteResult

from trainckpt.format import native_metadata

KEPT = 4
"""Layouts kept per process, as `plan_cache.KEPT`."""

_FIELDS = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
"""`Metadata`'s fields as this module knows them; another torch's metadata is always encoded."""
_MEMOIZE = pickle.MEMOIZE
_FRAME = pickle.FRAME[0]
_PROTO = pickle.PROTO[0]

counts: Counter[str] = Counter()
"""How many saves encoded their metadata files ("encoded") or reused them ("reused"); for
tests and benchmarks."""


@dataclass(frozen=True)
class Encoded:
    """The two files' bytes (`native` None: the format cannot describe this metadata)."""

    pickled: bytes
    native: bytes | None


@dataclass
class _Entry:
    entries: Any  # the `state_dict_metadata` object (held: compared by identity)
    planner_data: Any  # likewise
    version: str | None
    results: tuple[list[WriteResult], ...]  # the result lists (held: compared by identity)
    lengths: tuple[int, ...]  # and their lengths then
    storage_data: dict[MetadataIndex, _StorageInfo]
    pickled: tuple[bytes, bytes] | None  # around the storage meta; None: not splittable
    native: native_metadata.Parts | None
    rows: tuple[tuple[WriteResult, ...], ...]  # the results as they were (results are frozen)
    _layout: tuple[tuple[Any, ...], ...] | None = None

    def layout(self) -> tuple[tuple[Any, ...], ...] | None:
        """`_layout` of the results as they were kept, made when a later save first compares
        with it (a save that finds its very result lists again never does)."""
        if self._layout is None:
            self._layout = _layout([list(r) for r in self.rows])
        return self._layout


_lock = threading.Lock()
_kept: list[_Entry] = []


def forget() -> None:
    """Drop every kept layout (tests)."""
    with _lock:
        _kept.clear()


def encode(
    metadata: Metadata, results: list[list[WriteResult]], meta: StorageMeta | None
) -> Encoded:
    """Complete `metadata` as DCP's writer does (`storage_data` from every rank's `results`,
    `storage_meta` = `meta`) and return its two files' bytes, reused around `meta` when an
    earlier save had the same entries object, planner data, version and layout."""
    known = {f.name for f in dataclasses.fields(metadata)} == set(_FIELDS)
    entry = _find_same(metadata, results) if known else None
    if entry is None and known:
        entry = _find(metadata, results)
    if entry is not None:
        metadata.storage_data = entry.storage_data
        metadata.storage_meta = meta
        pickled = _assemble(entry.pickled, meta) if entry.pickled is not None else None
        native = entry.native.with_storage_meta(meta) if entry.native is not None else None
        if pickled is not None and (native is not None or entry.native is None):
            counts["reused"] += 1
            return Encoded(pickled, native)
    counts["encoded"] += 1
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for rs in results:
        storage.update({r.index: r.storage_data for r in rs})
    metadata.storage_data = storage
    metadata.storage_meta = meta
    parts = _pickle_parts(metadata)
    native_parts = native_metadata.encode_parts(metadata)
    if parts is not None and known and _plain(results):
        _keep(
            _Entry(
                metadata.state_dict_metadata,
                metadata.planner_data,
                metadata.version,
                tuple(results),
                tuple(map(len, results)),
                storage,
                parts,
                native_parts,
                tuple(map(tuple, results)),
            )
        )
    pickled = _assemble(parts, meta) if parts is not None else None
    return Encoded(
        pickled if pickled is not None else pickle.dumps(metadata),
        None if native_parts is None else native_parts.with_storage_meta(meta),
    )


def _layout(results: list[list[WriteResult]]) -> tuple[tuple[Any, ...], ...] | None:
    """Every result's index and place, in order; None if one is of a type not known here."""
    rows = []
    for rs in results:
        for r in rs:
            index, info = r.index, r.storage_data
            if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
                return None
            rows.append(
                (index.fqn, index.offset, index.index, info.relative_path, info.offset,
                 info.length, info.transform_descriptors)
            )  # fmt: skip
    return tuple(rows)


def _plain(results: list[list[WriteResult]]) -> bool:
    """Whether every result's index and place are of the types `_layout` knows."""
    return {type(r.index) for rs in results for r in rs} <= {MetadataIndex} and {
        type(r.storage_data) for rs in results for r in rs
    } <= {_StorageInfo}


def _find(metadata: Metadata, results: list[list[WriteResult]]) -> _Entry | None:
    """The kept layout of the same entries whose every result is where one of `results` is
    (the layouts are made only when there is such an entry: never on a save that planned).
    The entry found then holds `results` as its lists: a writer that hands them out again (an
    incremental save whose layout did not change, `core/incremental.py`) is found by identity
    (`_find_same`); the places they give are those of the entry's rows, compared equal."""
    with _lock:
        candidates = [e for e in _kept if _same_entries(e, metadata)]
    if not candidates:
        return None
    layout: tuple[tuple[Any, ...], ...] | None = ()
    with _lock:
        for entry in candidates:
            same = _same_rows(entry.rows, results)  # most results the very objects kept?
            if same is None:
                if layout == ():
                    layout = _layout(results)
                if layout is None:
                    return None
                same = entry.layout() == layout
            if same:
                entry.results = tuple(results)
                entry.lengths = tuple(map(len, results))
                return entry
    return None


def _same_rows(
    rows: tuple[tuple[WriteResult, ...], ...], results: list[list[WriteResult]]
) -> bool | None:
    """Whether `results` give every item the index and place of `rows`, compared item by item
    where they are not the very objects (an incremental save hands out the results of the
    files it took over again, `core/incremental.py`); None when that is not the cheaper way
    (other lengths, or fewer than half the objects shared)."""
    if len(rows) != len(results) or any(
        len(a) != len(b) for a, b in zip(rows, results, strict=True)
    ):
        return None
    differ = [
        (a, b)
        for kept, now in zip(rows, results, strict=True)
        for a, b in zip(kept, now, strict=True)
        if a is not b
    ]
    if 2 * len(differ) > sum(map(len, rows)):
        return None
    before, now = _layout([[a for a, _ in differ]]), _layout([[b for _, b in differ]])
    return before is not None and before == now


def _find_same(metadata: Metadata, results: list[list[WriteResult]]) -> _Entry | None:
    """The kept layout of the very same result lists: a writer that found every item where
    it was last time hands out the previous save's list again (`shard_writer._Files`), and a
    list is never changed once handed out. Saves one row per item over `_find`."""
    with _lock:
        for entry in _kept:
            if (
                _same_entries(entry, metadata)
                and len(entry.results) == len(results)
                and all(
                    a is b and len(a) == n
                    for a, b, n in zip(entry.results, results, entry.lengths, strict=True)
                )
            ):
                return entry
    return None


def _same_entries(entry: _Entry, metadata: Metadata) -> bool:
    return (
        entry.entries is metadata.state_dict_metadata
        and entry.planner_data is metadata.planner_data
        and entry.version == metadata.version
    )


def _keep(entry: _Entry) -> None:
    with _lock:
        _kept[:] = [e for e in _kept if e.entries is not entry.entries][-(KEPT - 1) :] + [entry]


def _pickle_parts(metadata: Metadata) -> tuple[bytes, bytes] | None:
    """DCP's pickle of `metadata` without frames, split around its storage meta (module
    docstring); None if it cannot be split (then it is pickled whole)."""
    marker = f"trainckpt-storage-meta-{uuid.uuid4().hex}"
    meta = metadata.storage_meta
    metadata.storage_meta = marker  # type: ignore[assignment]
    try:
        flat = _unframed(pickle.dumps(metadata))
    finally:
        metadata.storage_meta = meta
    raw = marker.encode()
    needle = pickle.SHORT_BINUNICODE + bytes([len(raw)]) + raw + _MEMOIZE
    if flat is None:
        return None
    before, found, after = flat.partition(needle)
    if not found or needle in after:
        return None
    return before, after


def _assemble(parts: tuple[bytes, bytes], meta: StorageMeta | None) -> bytes | None:
    """The pickle with `meta` in the marker's place: pickled without a memo, then stored at the
    marker's memo index."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out)
    pickler.fast = True  # no memo: nothing it writes is stored or referenced by index
    pickler.dump(meta)
    body = _unframed(out.getvalue())
    if body is None:
        return None
    return b"".join((parts[0], body[2:-1], _MEMOIZE, parts[1]))  # without PROTO and STOP


def _unframed(data: bytes) -> bytes | None:
    """`data` (one pickle) without its FRAME opcodes, which are optional; None if it is not
    made of whole frames (an object too large for a frame is written outside of them)."""
    if len(data) < 2 or data[0] != _PROTO or data[1] < 4:
        return data  # before protocol 4: no frames
    view = memoryview(data)
    chunks = [view[:2]]
    pos = 2
    while pos < len(data):
        if data[pos] != _FRAME or pos + 9 > len(data):
            return None
        size = int.from_bytes(view[pos + 1 : pos + 9], "little")
        chunks.append(view[pos + 9 : pos + 9 + size])
        pos += 9 + size
    return b"".join(chunks) if pos == len(data) else None
