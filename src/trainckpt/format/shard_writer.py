"""The storage writer that `torch.distributed.checkpoint` (DCP) saves through, made fast.

The files are exactly DCP's (each item `torch.save`d into per-rank `__{R}_{i}.distcp` shards,
plus DCP's pickled `.metadata`), so plain DCP and OLMo-core read them. What differs from DCP's
own `FileSystemWriter` is how they are written:

- one thread per shard file, all files of a rank written and fsynced in parallel, or the
  files written by another process (`ShardWriter`: `core/writer_process.py`);
- the CRC32C that the manifest needs is computed from the bytes as they are written, instead of
  reading every file back afterwards, without holding the interpreter lock
  (`checksummed_file`);
- no copy of a tensor unless it is a view into a larger storage (`torch.save` would otherwise
  write the whole storage) or lives off the CPU;
- empty shard files are not created;
- the items are written without the zip CRC32 that `torch.save` puts into each zip entry
  (`tensor_item.py`): the bytes are those of `torch.save` under
  `torch.serialization.set_crc32_options(False)`. `torch.load` (and so plain DCP and OLMo-core)
  never checks that CRC32, while every byte is covered by our CRC32C (manifest and item
  record), which is what the reader checks; the zip CRC32 was the largest CPU cost of a
  background save that writing the bytes does not have;
- a small tensor's item is not serialized one by one: `torch.save`'s bytes for a tensor are a
  fixed head, the storage's bytes and a fixed tail, which depend only on its dtype, shape,
  strides and storage size (`tensor_item.ItemTemplates`). The first tensor of each kind goes through
  `torch.save`'s serializer, which gives the head and tail; the next ones of that kind are
  written as head + bytes + tail in one write. Thousands of small tensors (MoE experts,
  optimizer step counters) then cost microseconds each, not the ~0.4 ms of a zip writer;
- with an incremental save (`core/incremental.py`), the items unchanged since the previous save
  fill files of their own, and a file whose items are all unchanged is taken over from the
  previous checkpoint (hard link, server-side copy) instead of being written;
- each shard file ends with an item record (`shard_checksums.py`): its own name, the save's id and
  the CRC32C of every item, computed from the bytes as they are written; the save id also goes
  into `.metadata` (`storage_meta.save_id`), so the reader can tell a misplaced or damaged
  shard without reading anything it would not read anyway. DCP's readers never read past the
  last item, so they are not affected;
- beside `.metadata`, the coordinator writes the same metadata in trainckpt's own format
  (`.metadata.trainckpt`, `native_metadata`), so trainckpt's loads never unpickle.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import io
import itertools
import operator
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import google_crc32c
import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from trainckpt.format import metadata_files, plain_values, shard_checksums
from trainckpt.format.content_hash import item_digest
from trainckpt.format.layout import DCP_METADATA_FILE, NATIVE_METADATA_FILE
from trainckpt.format.tensor_item import small_item, write_tensor
from trainckpt.storage.checksummed_file import ChecksummedWriter, checksummed_file
from trainckpt.storage.checksums import FileEntry, crc32c_bytes
from trainckpt.storage.local import writing


@dataclass
class Layout:
    """How one rank's items of a save go to files (an incremental save's choice)."""

    groups: list[list[WriteItem]]
    """Items to write: each group fills files of its own (unchanged ones first)."""
    reused_files: dict[str, FileEntry] = dataclasses.field(default_factory=dict)
    """Files taken over (name in the DCP folder -> size and CRC32C)."""


class ItemLayout(Protocol):
    """What lays a rank's items out in files and hears what was written, returning every
    item's result (those of the files taken over too): an incremental save
    (`core/incremental.py` `Session`)."""

    def lay_out(
        self,
        items: list[WriteItem],
        resolve: Callable[[WriteItem], ItemData],
        threads: int,
        values_of: Callable[[list[str]], list[Any]] | None = None,
    ) -> Layout: ...

    def record(
        self, shards: Sequence[Shard], written: Sequence[WrittenShard], save_id: str
    ) -> list[WriteResult]: ...


@dataclasses.dataclass
class _SavePrefix(_StoragePrefix):
    """DCP's per-rank file prefix plus the id of this save, chosen by the coordinator and sent
    to every rank with its plan (only between the ranks of this save; never stored)."""

    save_id: str = ""


@dataclass(frozen=True)
class ReusedResult(WriteResult):
    """The result of the first item of a file taken over from an earlier save, whose item
    record names that save (`source_save_id`): the coordinator lists it in `.metadata` beside
    its own. The file's other items may keep the plain results of the save that wrote it
    (`core/incremental.py`): one such result per file is enough to name the save."""

    source_save_id: str = ""


class RecordingWriter(FileSystemWriter):
    """DCP's storage writer for a local folder, writing shards in parallel and recording each
    file it wrote with size and CRC32C in `written`."""

    def __init__(
        self,
        path: Path,
        thread_count: int,
        durable: bool = True,
        on_file: Callable[[str], None] | None = None,
        shard_writer: ShardWriter | None = None,
        incremental: ItemLayout | None = None,
    ) -> None:
        """`thread_count`: shard files per rank. `on_file(name)` is called (on a writing
        thread) as soon as a shard is complete. `shard_writer` writes the files (default: one
        thread per file, `ThreadShardWriter`). `incremental`: this rank's incremental save,
        which lays the items out and takes unchanged files over (None: every file written)."""
        super().__init__(
            path, single_file_per_rank=True, sync_files=durable, thread_count=thread_count
        )
        self.written: dict[str, FileEntry] = {}
        self.on_file = on_file
        self.shard_writer = shard_writer or ThreadShardWriter()
        self.incremental = incremental

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """DCP's own step (creates the folder), with write errors naming the folder."""
        with writing(Path(self.path)):
            return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: DCP's file prefixes, plus one new save id for every rank."""
        self.save_id = shard_checksums.new_save_id()
        return [
            dataclasses.replace(
                p, storage_data=_SavePrefix(p.storage_data.prefix, save_id=self.save_id)
            )
            for p in super().prepare_global_plan(plans)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: DCP's own step (`.metadata`, with the save id recorded in it, and
        those of the saves that wrote files this one took over), then the same metadata in
        trainckpt's own format (`native_metadata`); both encoded, or reused from the last save
        of the same layout (`metadata_files`), and recorded in `written`, with write errors
        naming the file."""
        sources = _sources(results)
        self.save_id = shard_checksums.join_save_ids(self.save_id, sources)  # `storage_meta()`'s
        metadata.version = CURRENT_DCP_VERSION
        files = metadata_files.encode(metadata, results, self.storage_meta())
        self._write_file(DCP_METADATA_FILE, files.pickled)
        if files.native is not None:
            self._write_file(NATIVE_METADATA_FILE, files.native)

    def _write_file(self, name: str, data: bytes) -> None:
        """Write `data` as `name` in the folder as DCP's writer writes `.metadata`: into a
        temporary file (fsynced when durable), then renamed over any earlier one."""
        where = Path(self.path) / name
        tmp = where.with_name(f"{name}.tmp")
        with writing(where):
            with open(tmp, "wb") as f:
                f.write(data)
                if self.sync_files:
                    os.fsync(f.fileno())
            os.replace(tmp, where)
        self.written[name] = FileEntry(size=len(data), crc32c=crc32c_bytes(data))

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.save_id = plan.storage_data.save_id
        prefix = plan.storage_data.prefix
        resolve: Callable[[WriteItem], ItemData] = getattr(
            planner, "resolve_item", None
        ) or functools.partial(resolve_item, planner)
        results: list[WriteResult]
        files: _Files | None = None
        if self.incremental is None:
            files = _files(plan.items, self.thread_count)
            buckets = files.buckets
        else:
            values_of = getattr(planner, "values_of", None)
            layout = self.incremental.lay_out(plan.items, resolve, self.thread_count, values_of)
            for name, entry in layout.reused_files.items():
                self.written[name] = entry
            # a group handed out again (the same list: `Session.lay_out`) keeps its files
            buckets = [b for g in layout.groups for b in _files(g, self.thread_count).buckets]
        names = _free_names(prefix, set(self.written))
        shards = [Shard(next(names), items, resolve) for items in buckets]
        written = self.shard_writer.write_shards(
            Path(self.path),
            shards,
            self.save_id,
            self.sync_files,
            self.on_file,
            digests=self.incremental is not None,
        )
        for shard, done in zip(shards, written, strict=True):
            self.written[shard.name] = done.entry
        if files is not None:
            results = files.results(written)
        else:
            assert self.incremental is not None
            results = self.incremental.record(shards, written, self.save_id)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


_last_sources: tuple[tuple[list[WriteResult], ...], set[str]] | None = None


def _sources(results: list[list[WriteResult]]) -> set[str]:
    """The saves named by `ReusedResult`s among `results`; those of the last call when
    handed the very same lists again (a list is never changed once handed out)."""
    global _last_sources
    last = _last_sources
    if (
        last is not None
        and len(last[0]) == len(results)
        and all(map(operator.is_, last[0], results))
    ):
        return last[1]
    kinds = set().union(*(map(type, rs) for rs in results))  # by C loops: 1 per item
    sources = (
        {r.source_save_id for rs in results for r in rs if isinstance(r, ReusedResult)}
        if any(issubclass(k, ReusedResult) for k in kinds)
        else set()
    )
    _last_sources = (tuple(results), sources)
    return sources


@dataclass
class _Files:
    """How a plan's items go to files (`_buckets`, each in file order), kept while the plan is
    reused (`core/plan_cache.py` hands out the same items list), with the results of the last
    write: a save whose items all landed where they did last time reuses that list, and
    `metadata_files` then knows the layout unchanged by identity."""

    items: list[WriteItem]  # the plan's items (held: compared by identity)
    buckets: list[list[WriteItem]]
    last: tuple[list[WrittenShard], list[WriteResult]] | None = None

    def results(self, written: list[WrittenShard]) -> list[WriteResult]:
        """Every item's result (file, offset, length), in file order."""
        last = self.last
        if last is not None and len(last[0]) == len(written):
            if all(
                a.name == b.name and a.spans == b.spans
                for a, b in zip(last[0], written, strict=True)
            ):
                return last[1]
        results: list[WriteResult] = []
        for items, done in zip(self.buckets, written, strict=True):
            name = done.name
            results += write_results(items, name, done.spans)
        self.last = (written, results)
        return results


def write_results(
    items: Sequence[WriteItem],
    name: str,
    spans: Iterable[tuple[int, int]],
    source_save_id: str | None = None,
) -> list[WriteResult]:
    """The result of each item written into file `name` at (offset, length) `spans`: DCP's
    `WriteResult(index, length, _StorageInfo(name, offset, length))` (a `ReusedResult` naming
    `source_save_id`, for a file taken over from that save), with the attributes those
    constructors set, in the same order, set directly (`_SAME_FIELDS`): without a dataclass's
    `__init__` per item (tens of thousands of them on a save that planned) and without an
    attribute dict per object (more objects for the collector while the results are kept)."""
    if not _SAME_FIELDS:  # pragma: no cover - another torch
        if source_save_id is not None:
            return [
                ReusedResult(item.index, length, _StorageInfo(name, offset, length), source_save_id)
                for item, (offset, length) in zip(items, spans, strict=True)
            ]
        return [
            WriteResult(item.index, length, _StorageInfo(name, offset, length))
            for item, (offset, length) in zip(items, spans, strict=True)
        ]
    new, put = object.__new__, object.__setattr__
    kind = WriteResult if source_save_id is None else ReusedResult
    out: list[WriteResult] = []
    append = out.append
    for item, (offset, length) in zip(items, spans, strict=True):
        info = new(_StorageInfo)
        put(info, "relative_path", name)
        put(info, "offset", offset)
        put(info, "length", length)
        put(info, "transform_descriptors", None)
        result = new(kind)
        put(result, "index", item.index)
        put(result, "size_in_bytes", length)
        put(result, "storage_data", info)
        if source_save_id is not None:
            put(result, "source_save_id", source_save_id)
        append(result)
    return out


_SAME_FIELDS = list(ReusedResult(None, 0, None).__dict__) == [  # type: ignore[arg-type]
    "index",
    "size_in_bytes",
    "storage_data",
    "source_save_id",
] and list(_StorageInfo("", 0, 0).__dict__.items()) == [
    ("relative_path", ""),
    ("offset", 0),
    ("length", 0),
    ("transform_descriptors", None),
]
"""Whether DCP's constructors (and `ReusedResult`'s) set exactly the attributes `write_results` sets
itself."""


_files_lock = threading.Lock()
_kept_files: OrderedDict[tuple[int, int], _Files] = OrderedDict()
KEPT = 4
"""Plans whose files are kept per process, as `plan_cache.KEPT`."""


def _files(items: list[WriteItem], bins: int) -> _Files:
    """The files of `items` (`_buckets` in file order), from the last save of the same plan."""
    key = (id(items), bins)
    with _files_lock:
        found = _kept_files.get(key)
        if found is not None and found.items is items:
            _kept_files.move_to_end(key)
            return found
    made = _Files(items, [_file_order(b) for b in _buckets(bins, items) if b])
    with _files_lock:
        _kept_files[key] = made
        while len(_kept_files) > KEPT:
            _kept_files.popitem(last=False)
    return made


def _buckets(bins: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """`items` split into up to `bins` files as DCP's `_split_by_size_and_type` splits them:
    byte items dealt in turn, tensors largest first, each to the file with the fewest bytes
    so far; with a heap instead of a scan of every file per tensor."""
    if bins <= 1:
        return [list(items)]
    byte_io = WriteItemType.BYTE_IO
    buckets: list[list[WriteItem]] = [[] for _ in range(bins)]
    tensors: list[tuple[int, int, WriteItem]] = []
    n = 0
    for i, item in enumerate(items):
        if item.type == byte_io:
            buckets[n % bins].append(item)
            n += 1
        else:
            tensors.append((-_item_size(item), i, item))
    tensors.sort(key=_first_two)
    heap = [(0, b) for b in range(bins)]
    for negative, _, item in tensors:
        size, b = heap[0]
        buckets[b].append(item)
        heapq.heapreplace(heap, (size - negative, b))
    return buckets


def _first_two(row: tuple[int, int, WriteItem]) -> tuple[int, int]:
    return row[0], row[1]


def _item_size(item: WriteItem) -> int:
    """A tensor item's bytes, from its plan (DCP's `_item_size`)."""
    data = item.tensor_data
    assert data is not None, f"tensor item {item.index} has no tensor data"
    return data.size.numel() * data.properties.dtype.itemsize


ItemData = torch.Tensor | io.BytesIO | bytes
"""What an item holds on the CPU: a tensor, or the bytes of a byte item."""


@dataclass(frozen=True)
class Shard:
    """One shard file to write: its name and its items in file order, whose data `resolve`
    gives (on the writing thread: a view is cloned only when its turn comes)."""

    name: str
    items: list[WriteItem]
    resolve: Callable[[WriteItem], ItemData]

    def data(self) -> Iterable[ItemData]:
        """The data of every item in order, each resolved when its turn comes."""
        return map(self.resolve, self.items)


@dataclass(frozen=True)
class WrittenShard:
    """A shard file as written: size and CRC32C, and (offset, length) of each item in order."""

    name: str
    entry: FileEntry
    spans: list[tuple[int, int]]
    digests: list[bytes | None] | None = None
    """When asked for: each item's `content_hash.item_digest`, for a small tensor (its item
    bytes, made for the write: hashed by a C loop), else None."""


class ShardWriter(Protocol):
    """Writes the shard files of one rank (`ThreadShardWriter`, or a writer process)."""

    def write_shards(
        self,
        folder: Path,
        shards: list[Shard],
        save_id: str,
        fsync: bool,
        on_file: Callable[[str], None] | None,
        digests: bool = False,
    ) -> list[WrittenShard]:
        """Write every shard into `folder` (each file fsynced with `fsync`), calling
        `on_file(name)` as each is complete; return them in the order given (with their small
        tensors' digests if `digests`); raise the first failure once every file is finished
        or failed."""
        ...


class ThreadShardWriter:
    """Writes each shard file on its own thread of this process."""

    def write_shards(
        self,
        folder: Path,
        shards: list[Shard],
        save_id: str,
        fsync: bool,
        on_file: Callable[[str], None] | None,
        digests: bool = False,
    ) -> list[WrittenShard]:
        if not shards:
            return []

        def write(shard: Shard) -> WrittenShard:
            done = write_shard(folder, shard.name, shard.data(), save_id, fsync, digests)
            if on_file is not None:
                on_file(shard.name)
            return done

        with ThreadPoolExecutor(len(shards), thread_name_prefix="trainckpt-write") as pool:
            futures = [pool.submit(write, shard) for shard in shards]
            return [f.result() for f in futures]  # raises the first failure


def write_shard(
    folder: Path,
    name: str,
    items: Iterable[ItemData],
    save_id: str,
    fsync: bool,
    digests: bool = False,
) -> WrittenShard:
    """Write shard file `name`: each item (a tensor as `torch.save` writes it minus the zip
    CRC32, `tensor_item`; a byte item as it is), then its item record; fsynced with `fsync`.
    Small items are gathered into one write (`_SmallItems`), in runs of one kind handed over
    together (a run's checksums and places are computed in one pass, not item by item), and,
    with `digests`, a run of small tensors is hashed in the same way (`WrittenShard.digests`).
    Called on: a writer thread, or the writer process."""
    parts: list[tuple[int, int, int]] = []
    batch = _SmallItems.BATCH
    with checksummed_file(folder / name, fsync=fsync) as out:
        small = _SmallItems(out, parts, [] if digests else None)
        values: list[bytes] = []  # byte items not handed over yet
        raws: list[bytes] = []  # small tensors' items not handed over yet
        size = 0  # their bytes
        tensor = torch.Tensor
        for data in items:
            kind = type(data)
            if kind is tensor or (kind is not bytes and isinstance(data, tensor)):
                raw = small_item(data)  # type: ignore[arg-type]
                if values:
                    small.add_values(values)
                    values, size = [], 0
                if raw is None:
                    if raws:
                        small.add_items(raws)
                        raws, size = [], 0
                    small.flush()
                    out.start_part()
                    write_tensor(data, out)  # type: ignore[arg-type]
                    parts.append(out.part())
                    small.no_digests(1)
                    continue
                raws.append(raw)
                size += len(raw)
            else:  # a byte item: most items of a flattened optimizer state
                if kind is not bytes:
                    data = data.getvalue() if isinstance(data, io.BytesIO) else data  # type: ignore[union-attr]
                if raws:
                    small.add_items(raws)
                    raws, size = [], 0
                values.append(data)  # type: ignore[arg-type]
                size += len(data)  # type: ignore[arg-type]
            if size >= batch:
                if values:
                    small.add_values(values)
                if raws:
                    small.add_items(raws)
                values, raws, size = [], [], 0
        if values:
            small.add_values(values)
        if raws:
            small.add_items(raws)
        small.flush()
        out.write(shard_checksums.encode(name, save_id, parts))
    return WrittenShard(name, out.entry(), list(map(_SPAN, parts)), small.digests)


_SPAN = operator.itemgetter(0, 1)
"""(offset, length) of a part (offset, length, CRC32C)."""


class _SmallItems:
    """Items gathered into one write of up to about `BATCH` bytes: one CRC32C per item (each
    distinct byte item's computed once: a flattened optimizer state repeats its values), one
    write and one CRC32C of the file's bytes per batch, where writing each item on its own
    cost a file write and two checksum calls per item. Items come in runs, whose places and
    checksums are computed by C loops (`map`, `accumulate`), not a Python step per item.

    A small item whose bytes equal one already in the file is not written again: its place
    is that item's (DCP's `.metadata` maps each item to an offset and a length, and nothing
    asks them to be disjoint; every reader reads each item's range on its own). Items longer
    than `plain_values.MAX_ITEM_BYTES` are shared only within their run, so the bytes kept to
    compare stay about one batch, not the file's. A flattened
    optimizer state holds thousands of equal hyperparameters of about 1.2 KB each (a
    `torch.save` of a float), and the AdamW step counters are equal tensors: at 64,000 state
    entries that was most of the bytes written and read back (docs/scale.md)."""

    BATCH = 1 << 20

    def __init__(
        self,
        out: ChecksummedWriter,
        parts: list[tuple[int, int, int]],
        digests: list[bytes | None] | None = None,
    ) -> None:
        self._out, self._parts = out, parts
        self.digests = digests
        """If kept: each item's digest in order (`WrittenShard.digests`)."""
        self._pending: list[bytes] = []
        self._size = 0
        self._crcs: dict[bytes, int] = {}
        self._placed: dict[bytes, tuple[int, int, int]] = {}
        """Small items written to this file (or pending), by their bytes: (offset, length,
        CRC32C); those longer than `plain_values.MAX_ITEM_BYTES` only within their run."""

    def add_items(self, items: list[bytes]) -> None:
        """Append tensors' items, in order (equal ones shared)."""
        if self.digests is not None:
            self.digests += map(item_digest, items)
        self._extend(items, None)

    def add_values(self, items: list[bytes]) -> None:
        """Append byte items, in order; the CRC32C of equal small items is computed once."""
        self.no_digests(len(items))
        self._extend(items, self._crcs)

    def no_digests(self, count: int) -> None:
        """`count` items with no digest (byte items, large tensors) come next."""
        if self.digests is not None:
            self.digests += itertools.repeat(None, count)

    def _extend(self, items: list[bytes], known: dict[bytes, int] | None) -> None:
        placed = self._placed
        new = [data for data in dict.fromkeys(items) if data not in placed]
        if new:
            if known is None:
                crcs = list(map(google_crc32c.value, new))
            else:
                crcs = []
                for data in new:
                    crc = known.get(data)
                    if crc is None:
                        crc = google_crc32c.value(data)
                        if len(data) <= plain_values.MAX_ITEM_BYTES:
                            known[data] = crc
                    crcs.append(crc)
            lengths = list(map(len, new))
            # each new item's offset, then where the last one ends (left out by zip)
            offsets = itertools.accumulate(lengths, initial=self._out.tell() + self._size)
            placed.update(zip(new, zip(offsets, lengths, crcs, strict=False), strict=True))
            self._pending += new
            self._size += sum(lengths)
        self._parts.extend(map(placed.__getitem__, items))
        for data in new:  # only items as small as a plain value stay shared past their run:
            if len(data) > plain_values.MAX_ITEM_BYTES:  # memory stays about one batch
                del placed[data]
        if self._size >= self.BATCH:
            self.flush()

    def flush(self) -> None:
        """Write what was gathered."""
        if self._pending:
            self._out.write(b"".join(self._pending))
            self._pending.clear()
            self._size = 0


def _free_names(prefix: str, taken: set[str]) -> Iterator[str]:
    """Shard file names `{prefix}{i}.distcp` for i = 0, 1, ..., but those `taken` (by files
    taken over from an earlier save)."""
    for i in itertools.count():
        name = f"{prefix}{i}{DEFAULT_SUFFIX}"
        if name not in taken:
            yield name


def _file_order(items: list[WriteItem]) -> list[WriteItem]:
    """Byte items first, then tensors, as DCP's own writer orders a file."""
    return [i for i in items if i.type == WriteItemType.BYTE_IO] + [
        i for i in items if i.type != WriteItemType.BYTE_IO
    ]


def resolve_item(planner: SavePlanner, item: WriteItem) -> ItemData:
    """The data of one item, on the CPU, as DCP's own writer prepares it (a planner may
    offer a faster `resolve_item` of its own: `core/dcp.py`)."""
    data = planner.resolve_data(item)
    if isinstance(data, torch.Tensor):
        if data.requires_grad:
            data = data.detach()
        if not data.is_cpu:
            data = data.cpu()
        if data.untyped_storage().size() != data.nbytes:
            data = data.clone()  # a view: torch.save would write its whole storage
    return data
