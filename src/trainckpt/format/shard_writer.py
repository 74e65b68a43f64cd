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
import io
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import google_crc32c
import torch
from torch.distributed.checkpoint.filesystem import (
    CURRENT_DCP_VERSION,
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from trainckpt.format import metadata_files, plain_values, shard_checksums
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
    reused_results: list[WriteResult] = dataclasses.field(default_factory=list)


class ItemLayout(Protocol):
    """What lays a rank's items out in files and hears what was written: an incremental save
    (`core/incremental.py` `Session`)."""

    def lay_out(
        self, items: list[WriteItem], resolve: Callable[[WriteItem], ItemData], threads: int
    ) -> Layout: ...

    def record(
        self, shards: Sequence[Shard], written: Sequence[WrittenShard], save_id: str
    ) -> None: ...


@dataclasses.dataclass
class _SavePrefix(_StoragePrefix):
    """DCP's per-rank file prefix plus the id of this save, chosen by the coordinator and sent
    to every rank with its plan (only between the ranks of this save; never stored)."""

    save_id: str = ""


@dataclass(frozen=True)
class ReusedResult(WriteResult):
    """The result of an item in a file taken over from an earlier save, whose item record names
    that save (`source_save_id`): the coordinator lists it in `.metadata` beside its own."""

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
        sources = {r.source_save_id for rs in results for r in rs if isinstance(r, ReusedResult)}
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
        resolve = functools.partial(_resolve, planner)
        results: list[WriteResult] = []
        groups = [plan.items]  # the items of each group fill files of their own
        if self.incremental is not None:
            layout = self.incremental.lay_out(plan.items, resolve, self.thread_count)
            groups = layout.groups
            for name, entry in layout.reused_files.items():
                self.written[name] = entry
            results += layout.reused_results
        names = _free_names(prefix, set(self.written))
        buckets = [b for g in groups for b in _split_by_size_and_type(self.thread_count, g) if b]
        shards = [Shard(next(names), _file_order(items), resolve) for items in buckets]
        written = self.shard_writer.write_shards(
            Path(self.path), shards, self.save_id, self.sync_files, self.on_file
        )
        for shard, done in zip(shards, written, strict=True):
            self.written[shard.name] = done.entry
            for item, (offset, length) in zip(shard.items, done.spans, strict=True):
                info = _StorageInfo(shard.name, offset, length)
                results.append(WriteResult(item.index, length, info))
        if self.incremental is not None:
            self.incremental.record(shards, written, self.save_id)
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future


ItemData = torch.Tensor | io.BytesIO | bytes
"""What an item holds on the CPU: a tensor, or the bytes of a byte item."""


@dataclass(frozen=True)
class Shard:
    """One shard file to write: its name and its items in file order, whose data `resolve`
    gives (on the writing thread: a view is cloned only when its turn comes)."""

    name: str
    items: list[WriteItem]
    resolve: Callable[[WriteItem], ItemData]


@dataclass(frozen=True)
class WrittenShard:
    """A shard file as written: size and CRC32C, and (offset, length) of each item in order."""

    name: str
    entry: FileEntry
    spans: list[tuple[int, int]]


class ShardWriter(Protocol):
    """Writes the shard files of one rank (`ThreadShardWriter`, or a writer process)."""

    def write_shards(
        self,
        folder: Path,
        shards: list[Shard],
        save_id: str,
        fsync: bool,
        on_file: Callable[[str], None] | None,
    ) -> list[WrittenShard]:
        """Write every shard into `folder` (each file fsynced with `fsync`), calling
        `on_file(name)` as each is complete; return them in the order given; raise the first
        failure once every file is finished or failed."""
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
    ) -> list[WrittenShard]:
        if not shards:
            return []

        def write(shard: Shard) -> WrittenShard:
            items = (shard.resolve(item) for item in shard.items)
            done = write_shard(folder, shard.name, items, save_id, fsync)
            if on_file is not None:
                on_file(shard.name)
            return done

        with ThreadPoolExecutor(len(shards), thread_name_prefix="trainckpt-write") as pool:
            futures = [pool.submit(write, shard) for shard in shards]
            return [f.result() for f in futures]  # raises the first failure


def write_shard(
    folder: Path, name: str, items: Iterable[ItemData], save_id: str, fsync: bool
) -> WrittenShard:
    """Write shard file `name`: each item (a tensor as `torch.save` writes it minus the zip
    CRC32, `tensor_item`; a byte item as it is), then its item record; fsynced with `fsync`.
    Small items are gathered into one write (`_SmallItems`). Called on: a writer thread, or
    the writer process."""
    parts: list[tuple[int, int, int]] = []
    with checksummed_file(folder / name, fsync=fsync) as out:
        small = _SmallItems(out, parts)
        for data in items:
            if isinstance(data, torch.Tensor):
                raw = small_item(data)
                if raw is None:
                    small.flush()
                    out.start_part()
                    write_tensor(data, out)
                    parts.append(out.part())
                    continue
                small.add(raw)
            else:
                small.add(data.getvalue() if isinstance(data, io.BytesIO) else data, repeats=True)
        small.flush()
        out.write(shard_checksums.encode(name, save_id, parts))
    return WrittenShard(name, out.entry(), [(offset, length) for offset, length, _ in parts])


class _SmallItems:
    """Items gathered into one write of up to `BATCH` bytes: one call per item for its own
    CRC32C (each distinct byte item's computed once: a flattened optimizer state repeats its
    values), one write and one CRC32C of the file's bytes per batch, where writing each item
    on its own cost a file write and two checksum calls per item."""

    BATCH = 1 << 20

    def __init__(self, out: ChecksummedWriter, parts: list[tuple[int, int, int]]) -> None:
        self._out, self._parts = out, parts
        self._pending: list[bytes] = []
        self._size = 0
        self._crcs: dict[bytes, int] = {}

    def add(self, data: bytes, repeats: bool = False) -> None:
        """Append item `data`: its part (offset, length, CRC32C) is recorded now. With
        `repeats` (a byte item), the CRC32C of small equal items is computed once."""
        crc = self._crcs.get(data) if repeats else None
        if crc is None:
            crc = google_crc32c.value(data)
            if repeats and len(data) <= plain_values.MAX_ITEM_BYTES:
                self._crcs[data] = crc
        self._parts.append((self._out.tell() + self._size, len(data), crc))
        self._pending.append(data)
        self._size += len(data)
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


def _resolve(planner: SavePlanner, item: WriteItem) -> ItemData:
    """The data of one item, on the CPU, as DCP's own writer prepares it."""
    data = planner.resolve_data(item)
    if isinstance(data, torch.Tensor):
        if data.requires_grad:
            data = data.detach()
        if not data.is_cpu:
            data = data.cpu()
        if data.untyped_storage().size() != data.nbytes:
            data = data.clone()  # a view: torch.save would write its whole storage
    return data
