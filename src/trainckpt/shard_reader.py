"""The read loop of `torch.distributed.checkpoint` (DCP), on several threads.

DCP's `FileSystemReader.read_data` reads every item of every shard one after the other on the
calling thread: the disk waits while a tensor is deserialized and copied, and the copy waits
while the disk reads. Here the items are split into contiguous runs of about equal size, one per
thread, each thread with its own file handles; reading, `torch.load(weights_only=True)` and the
copy into the target release the GIL. The planner is only called under a lock.
"""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import IO, Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future


class ParallelReader(FileSystemReader):
    """DCP's file reader with `thread_count` reading threads; same files, same results."""

    # Any of DCP's file systems (DCP declares the local one): ours serves remote storage too.
    fs: FileSystemBase  # type: ignore[assignment]

    def __init__(self, path: Any, thread_count: int = 4) -> None:
        super().__init__(path)
        self.thread_count = max(1, thread_count)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        def where(req: ReadItem) -> tuple[str, int]:
            info = self.storage_data[req.storage_index]
            return info.relative_path, info.offset

        items = sorted(plan.items, key=where)
        runs = _split_runs(
            items, self.thread_count, lambda r: self.storage_data[r.storage_index].length
        )
        lock = threading.Lock()
        if len(runs) <= 1:
            for run in runs:
                self._read_run(run, planner, lock)
        else:
            with ThreadPoolExecutor(len(runs), thread_name_prefix="trainckpt-read") as pool:
                for future in [pool.submit(self._read_run, run, planner, lock) for run in runs]:
                    future.result()  # raises the first failure
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_run(self, reqs: list[ReadItem], planner: LoadPlanner, lock: threading.Lock) -> None:
        with ExitStack() as stack:
            streams: dict[str, Any] = {}
            for req in reqs:
                info = self.storage_data[req.storage_index]
                stream = streams.get(info.relative_path)
                if stream is None:
                    path = self.fs.concat_path(self.path, info.relative_path)
                    stream = stack.enter_context(self.fs.create_stream(path, "rb"))
                    streams[info.relative_path] = stream
                self._read_item(req, self._slice_file(stream, info), planner, lock)

    def _read_item(
        self, req: ReadItem, file_slice: IO[bytes], planner: LoadPlanner, lock: threading.Lock
    ) -> None:
        info = self.storage_data[req.storage_index]
        data = self.transforms.transform_load_stream(
            req, info.transform_descriptors or (), file_slice
        )
        if req.type == LoadItemType.BYTE_IO:
            raw = io.BytesIO(data.read(-1))
            with lock:
                planner.load_bytes(req, raw)
            return
        seekable = data if data.seekable() else io.BytesIO(data.read(-1))
        tensor = torch.load(seekable, map_location="cpu", weights_only=True)
        tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
        with lock:
            target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise ValueError(
                f"item {req.storage_index.fqn}: the checkpoint holds shape {tuple(tensor.size())}, "
                f"the state to load into has {tuple(target.size())}"
            )
        target.copy_(tensor)
        with lock:
            planner.commit_tensor(req, target)


def _split_runs(
    items: list[ReadItem], n: int, size: Callable[[ReadItem], int]
) -> list[list[ReadItem]]:
    """`items` cut into at most `n` contiguous runs of about equal total size."""
    total = sum(size(i) for i in items)
    runs: list[list[ReadItem]] = [[]]
    filled = 0
    for item in items:
        if runs[-1] and len(runs) < n and filled >= total * len(runs) / n:
            runs.append([])
        runs[-1].append(item)
        filled += size(item)
    return [r for r in runs if r]
