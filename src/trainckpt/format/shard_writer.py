"""The storage writer that `torch.distributed.checkpoint` (DCP) saves through, made fast.

The files are exactly DCP's (each item `torch.save`d into per-rank `__{R}_{i}.distcp` shards,
plus DCP's pickled `.metadata`), so plain DCP and OLMo-core read them. What differs from DCP's
own `FileSystemWriter` is how they are written:

- one thread per shard file, all files of a rank written and fsynced in parallel;
- the CRC32C that the manifest needs is computed from the bytes as they are written, instead of
  reading every file back afterwards, without holding the interpreter lock
  (`checksummed_file`);
- no copy of a tensor unless it is a view into a larger storage (`torch.save` would otherwise
  write the whole storage) or lives off the CPU;
- empty shard files are not created;
- the items are written without the zip CRC32 that `torch.save` puts into each zip entry
  (`_save_item`): the bytes are those of `torch.save` under
  `torch.serialization.set_crc32_options(False)`. `torch.load` (and so plain DCP and OLMo-core)
  never checks that CRC32, while every byte is covered by our CRC32C (manifest and item
  record), which is what the reader checks; the zip CRC32 was the largest CPU cost of a
  background save that writing the bytes does not have;
- each shard file ends with an item record (`item_record`): its own name, the save's id and
  the CRC32C of every item, computed from the bytes as they are written; the save id also goes
  into `.metadata` (`storage_meta.save_id`), so the reader can tell a misplaced or damaged
  shard without reading anything it would not read anyway. DCP's readers never read past the
  last item, so they are not affected.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, cast

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
    _write_item,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _save

from trainckpt.format import item_record
from trainckpt.format.layout import DCP_METADATA_FILE
from trainckpt.storage.checksummed_file import ChecksummedWriter, checksummed_file
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.local import writing


@dataclasses.dataclass
class _SavePrefix(_StoragePrefix):
    """DCP's per-rank file prefix plus the id of this save, chosen by the coordinator and sent
    to every rank with its plan (only between the ranks of this save; never stored)."""

    save_id: str = ""


class RecordingWriter(FileSystemWriter):
    """DCP's storage writer for a local folder, writing shards in parallel and recording each
    file it wrote with size and CRC32C in `written`."""

    def __init__(
        self,
        path: Path,
        thread_count: int,
        durable: bool = True,
        on_file: Callable[[str], None] | None = None,
    ) -> None:
        """`on_file(name)` is called (on the writing thread) as soon as a shard is complete."""
        super().__init__(
            path, single_file_per_rank=True, sync_files=durable, thread_count=thread_count
        )
        self.written: dict[str, FileEntry] = {}
        self.on_file = on_file

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        """DCP's own step (creates the folder), with write errors naming the folder."""
        with writing(Path(self.path)):
            return super().prepare_local_plan(plan)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Coordinator: DCP's file prefixes, plus one new save id for every rank."""
        self.save_id = item_record.new_save_id()
        return [
            dataclasses.replace(
                p, storage_data=_SavePrefix(p.storage_data.prefix, save_id=self.save_id)
            )
            for p in super().prepare_global_plan(plans)
        ]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Coordinator: DCP's own step (writes `.metadata`, with the save id recorded in it),
        with write errors naming the file."""
        metadata.storage_meta = StorageMeta(save_id=self.save_id)
        with writing(Path(self.path) / DCP_METADATA_FILE):
            super().finish(metadata, results)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.save_id = plan.storage_data.save_id
        prefix = plan.storage_data.prefix
        buckets = [b for b in _split_by_size_and_type(self.thread_count, plan.items) if b]
        names = [f"{prefix}{i}{DEFAULT_SUFFIX}" for i in range(len(buckets))]
        results: list[WriteResult] = []
        if buckets:
            with ThreadPoolExecutor(len(buckets), thread_name_prefix="trainckpt-write") as pool:
                futures = [
                    pool.submit(self._write_file, name, items, planner)
                    for name, items in zip(names, buckets, strict=True)
                ]
                for name, future in zip(names, futures, strict=True):
                    entry, file_results = future.result()  # raises the first failure
                    self.written[name] = entry
                    results.extend(file_results)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> tuple[FileEntry, list[WriteResult]]:
        """Write one shard file (byte items first, then tensors, as DCP does), then its item
        record; fsynced."""
        ordered = [i for i in items if i.type == WriteItemType.BYTE_IO]
        ordered += [i for i in items if i.type != WriteItemType.BYTE_IO]
        results = []
        parts = []
        with checksummed_file(Path(self.path) / name, fsync=self.sync_files) as out:
            for item in ordered:
                data = _resolve(planner, item)
                out.start_part()
                results.append(self._write_item(out, data, item, name))
                parts.append(out.part())
            out.write(item_record.encode(name, self.save_id, parts))
        if self.on_file is not None:
            self.on_file(name)
        return out.entry(), results

    def _write_item(
        self, out: ChecksummedWriter, data: torch.Tensor | io.BytesIO, item: WriteItem, name: str
    ) -> WriteResult:
        """One item at the end of `out`: a tensor as `torch.save` writes it minus the zip
        CRC32 (`_save_item`); byte items, and anything DCP's storage extensions transform, by
        DCP's own item writer."""
        if not isinstance(data, torch.Tensor) or self.transforms.extensions:
            return _write_item(self.transforms, out, data, item, name, self.serialization_format)  # type: ignore[arg-type]
        offset = out.tell()
        _save_item(data, out)
        length = out.tell() - offset
        return WriteResult(
            index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)
        )


def _save_item(tensor: torch.Tensor, out: ChecksummedWriter) -> None:
    """`torch.save(tensor, out)` without the zip CRC32, the same bytes as `torch.save` under
    `set_crc32_options(False)`. That option is not a safe switch here: in torch 2.13 it is a
    per-thread value (a ContextVar: set by the caller of a save, it never reaches the writer
    threads), in earlier versions a process-global one (it would also drop the CRC32 of a
    `torch.save` the trainer runs meanwhile). So the zip writer is opened here, per call, with
    the CRC32 off, and `torch.save`'s own serializer writes into it: no shared state at all
    (private functions of torch.serialization; torch is pinned and
    `tests/test_shard_writer.py` compares the bytes with `torch.save`'s)."""
    writer = torch._C.PyTorchFileWriter(cast(IO[bytes], out), False, _get_storage_alignment())
    try:
        _save(tensor, writer, pickle, DEFAULT_PROTOCOL, False)
    except BaseException:
        # Finalize even after a failed write (as torch.save's own opener does): a zip writer
        # left open finalizes in its C++ destructor when it is garbage-collected, and a write
        # that fails there throws out of a destructor, which aborts the whole process.
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()


def _resolve(planner: SavePlanner, item: WriteItem) -> torch.Tensor | io.BytesIO:
    """The data of one item, on the CPU, as DCP's own writer prepares it."""
    data = planner.resolve_data(item)
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu()
        if data.untyped_storage().size() != data.nbytes:
            data = data.clone()  # a view: torch.save would write its whole storage
    return data
