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
- each shard file ends with an item record (`item_record`): its own name, the save's id and
  the CRC32C of every item, computed from the bytes as they are written; the save id also goes
  into `.metadata` (`storage_meta.save_id`), so the reader can tell a misplaced or damaged
  shard without reading anything it would not read anyway. DCP's readers never read past the
  last item, so they are not affected.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemWriter,
    _split_by_size_and_type,
    _StoragePrefix,
    _write_item,
)
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from trainckpt.format import item_record
from trainckpt.format.layout import DCP_METADATA_FILE
from trainckpt.storage.checksummed_file import checksummed_file
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
                results.append(
                    _write_item(self.transforms, out, data, item, name, self.serialization_format)  # type: ignore[arg-type]
                )
                parts.append(out.part())
            out.write(item_record.encode(name, self.save_id, parts))
        if self.on_file is not None:
            self.on_file(name)
        return out.entry(), results


def _resolve(planner: SavePlanner, item: WriteItem) -> torch.Tensor | io.BytesIO:
    """The data of one item, on the CPU, as DCP's own writer prepares it."""
    data = planner.resolve_data(item)
    if isinstance(data, torch.Tensor):
        data = data.detach().cpu()
        if data.untyped_storage().size() != data.nbytes:
            data = data.clone()  # a view: torch.save would write its whole storage
    return data
