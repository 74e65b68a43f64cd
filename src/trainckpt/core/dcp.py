"""Glue to `torch.distributed.checkpoint` (DCP): a writer that records what it wrote, and a
reader that loads through our storage interface without ever unpickling arbitrary objects.

Plain DCP unpickles its `.metadata` file and loads non-tensor values with
`torch.load(weights_only=False)`: a crafted checkpoint could run code. Here `.metadata` is read
by `safe_unpickle.load_dcp_metadata` (an exact allow-list) and values by `load_torch_plain`.
"""

from __future__ import annotations

import copy
import io
import itertools
import logging
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.tensor import DTensor

from trainckpt.core import dist, plan_cache
from trainckpt.core.gc_pause import paused_gc
from trainckpt.errors import CheckpointError, StorageError
from trainckpt.format import native_metadata, plain_values, shard_checksums, shard_writer
from trainckpt.format.safe_unpickle import load_torch_plain
from trainckpt.format.shard_reader import ParallelReader
from trainckpt.format.shard_writer import RecordingWriter, ShardWriter
from trainckpt.identity import identity
from trainckpt.storage import Storage
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.ranged import RangeReader

if TYPE_CHECKING:
    from trainckpt.core.incremental import Session

log = logging.getLogger(__name__)

# -- saving ------------------------------------------------------------------------------------


def save_state(
    state: dict[str, Any],
    folder: Path,
    *,
    group: dist.ProcessGroup | None,
    thread_count: int,
    durable: bool = True,
    on_file: Callable[[str], None] | None = None,
    prefix: str | None = None,
    shard_writer: ShardWriter | None = None,
    incremental: Session | None = None,
) -> dict[str, FileEntry]:
    """Write `state` as a DCP folder of up to `thread_count` shard files per rank, written by
    `shard_writer` (default: one thread per file), and return the files this rank wrote
    (relative to the checkpoint folder: `prefix` + name, `prefix` defaulting to the DCP
    folder's name and a slash) with size and CRC32C; with `durable`, every file is fsynced.
    `on_file` gets each shard's path (the same relative path) as soon as it is complete.
    With `incremental`, shard files unchanged since the previous save are taken over, not
    written (`incremental.py`; `on_file` is not called for them).

    Called on: all ranks (DCP plans collectively; rank 0 also writes `.metadata`).
    """
    rel = f"{folder.name}/" if prefix is None else prefix
    writer = RecordingWriter(
        folder,
        thread_count=thread_count,
        durable=durable,
        on_file=None if on_file is None else lambda name: on_file(f"{rel}{name}"),
        shard_writer=shard_writer,
        incremental=incremental,
    )
    where = f"writing DCP state into '{folder}'"
    with paused_gc(), _quiet_single_process(), plain_errors(where, StorageError):
        try:
            written = _save(state, writer, group)
        except BaseException:
            plan_cache.forget()  # every rank sees the failure: all plan the next save anew
            raise
    # shards and (rank 0) the metadata files: CRC32C computed from the bytes written
    return {f"{rel}{n}": e for n, e in written.items()}


def _save(
    state: dict[str, Any], writer: RecordingWriter, group: dist.ProcessGroup | None
) -> dict[str, FileEntry]:
    """`dcp.save` with our planner; returns the files written. Its own function so that the
    planner (the flat state, its signature: tens of thousands of young objects) is freed
    before the collector resumes: otherwise its first collection walks them all."""
    planner = _SavePlanner(dist.get_rank(group), dist.get_world_size(group))
    dcp.save(
        state,
        storage_writer=writer,
        planner=planner,
        process_group=group,
        no_dist=dist.get_world_size(group) == 1,  # DCP's collectives pickle every plan
    )
    return writer.written


_ABSENT = object()
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


class _SavePlanner(plan_cache.ReusingSavePlanner):
    """DCP's save planner, reusing the last plan of the same structure (`plan_cache`), minus
    the deduplication across ranks when there is one rank: DCP hashes every item's index to
    find items that several ranks hold (a tenth of a one-rank save of thousands of entries),
    and with one plan it returns that plan unchanged."""

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        if len(all_plans) == 1:
            return all_plans
        return super()._dedup_save_plans(all_plans)

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(rank, world)
        self._saved: dict[int, tuple[Any, bytes]] = {}

    def resolve_item(self, write_item: WriteItem) -> Any:
        """What the shard writer writes for an item (`shard_writer.resolve_item`: the data
        on the CPU, a view cloned), in one call for the common kinds: a whole plain CPU
        tensor, or a plain value whose bytes were made for the same object before in this
        save (a flattened optimizer state holds each hyperparameter object once per
        parameter). Anything else as `resolve_data`, then `shard_writer.resolve_item`."""
        index = write_item.index
        obj = self.state_dict.get(index.fqn, _ABSENT)
        kind = type(obj)
        if kind is torch.Tensor and index.offset is not None and not any(index.offset):
            if (
                len(index.offset) == obj.dim()
                and not obj.requires_grad
                and obj.is_cpu
                and obj.untyped_storage().nbytes() == obj.nbytes
            ):
                return obj
        elif index.offset is None and kind not in _PLAIN_TENSORS:
            known = self._saved.get(identity(obj))
            if known is not None and known[0] is obj:
                return known[1]
        data = shard_writer.resolve_item(self, write_item)
        if (
            write_item.type == WriteItemType.BYTE_IO
            and type(data) is bytes
            and plain_values.value_key(obj) is not None
        ):
            self._saved[identity(obj)] = (obj, data)  # immutable: same object, same bytes
        return data

    def values_of(self, fqns: list[str]) -> list[Any]:
        """The state value behind each of `fqns` (`_ABSENT` where there is none), by a C loop:
        `Session.lay_out` skips resolving a byte item whose value is the very object of the
        last save."""
        return list(map(self.state_dict.get, fqns, itertools.repeat(_ABSENT)))

    def resolve_data(self, write_item: WriteItem) -> Any:
        """DCP's value of an item, found directly for a plain value or a whole plain tensor
        (what DCP's lookup returns for them, without its checks for sharded kinds), through
        DCP's lookup for anything else (shards of a DTensor, an index it refuses)."""
        index = write_item.index
        obj = self.state_dict.get(index.fqn, _ABSENT)
        if type(obj) in _PLAIN_TENSORS:
            whole = index.offset is None or (
                len(index.offset) == obj.dim() and not any(index.offset)
            )
            if whole:
                return self.transform_object(write_item, obj)
        elif obj is not _ABSENT and not isinstance(obj, torch.Tensor) and index.offset is None:
            return self.transform_object(write_item, obj)
        return super().resolve_data(write_item)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        """A byte item as DCP writes it (`torch.save`), each distinct small value serialized
        once (`plain_values`): a flattened optimizer state repeats its hyperparameters per
        parameter."""
        if write_item.type == WriteItemType.BYTE_IO:
            return plain_values.saved_bytes(object)  # our writer takes bytes as they are
        return object


# -- loading -----------------------------------------------------------------------------------


class _StorageFS(FileSystemBase):
    """DCP's read-side file system calls served by one of our storage back ends (from the
    local copies in `downloaded`, remote location -> local path, where there is one)."""

    def __init__(self, storage: Storage, downloaded: dict[str, Path] | None = None) -> None:
        self.storage = storage
        self.downloaded = downloaded or {}

    @contextmanager
    def create_stream(self, path: Any, mode: str) -> Generator[Any, None, None]:
        if mode != "rb":
            raise ValueError("read-only")
        local = self.downloaded.get(str(path))
        with open(local, "rb") if local is not None else self.storage.open_read(str(path)) as f:
            yield f

    def concat_path(self, path: Any, suffix: str) -> str:
        return self.storage.join(str(path), suffix)

    def init_path(self, path: Any) -> str:
        return str(path)

    def exists(self, path: Any) -> bool:
        return self.storage.exists(str(path))

    def rename(self, path: Any, new_path: Any) -> None:
        raise NotImplementedError

    def mkdir(self, path: Any) -> None:
        raise NotImplementedError

    def rm_file(self, path: Any) -> None:
        raise NotImplementedError

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True


class _SafeReader(ParallelReader):
    """Reads shards through `storage`: byte ranges on demand, or, with `download_to`, local
    copies of the shard files this rank's plan needs, downloaded in parallel first."""

    def __init__(
        self,
        storage: Storage,
        folder: str,
        metadata: Metadata,
        download_to: Path | None = None,
        thread_count: int = 4,
        check_items: bool = True,
    ) -> None:
        save_id = _save_id(metadata, folder) if check_items else None
        super().__init__(folder, thread_count, save_id)
        self.fs = _StorageFS(storage)
        self.path = folder
        self._metadata = metadata
        self._storage = storage
        self._download_to = download_to
        self._thread_count = thread_count

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        if self._download_to is not None:
            self.fs = self._downloaded_fs(plan, planner, self._download_to)  # type: ignore[assignment]
        return super().read_data(plan, planner)

    def _downloaded_fs(self, plan: LoadPlan, planner: LoadPlanner, cache_dir: Path) -> _StorageFS:
        storage = self.storage() if plan.items else {}
        names = {storage[item.storage_index].relative_path for item in plan.items}
        names.update(info.relative_path for info, _ in self._direct_work(planner))
        remote = sorted(self._storage.join(str(self.path), name) for name in names)
        threads = max(1, min(self._thread_count, len(remote)))
        with ThreadPoolExecutor(threads, thread_name_prefix="trainckpt-download") as pool:
            local = list(pool.map(lambda r: self._storage.local_copy(r, cache_dir), remote))
        return _StorageFS(self._storage, dict(zip(remote, local, strict=True)))

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        if isinstance(file, RangeReader):  # remote: one ranged read per item, not many seeks
            return io.BytesIO(file.read_range(sinfo.offset, sinfo.length))
        return super()._slice_file(file, sinfo)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = copy.copy(self._metadata)  # trainckpt's own keeps its storage keys unbuilt
        md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        if getattr(md, "planner_built", True) and md.planner_data is None:  # unbuilt: a dict
            md.planner_data = {}
        return md


def _save_id(metadata: Metadata, folder: str) -> str | None:
    """The id of the save that wrote `folder`, if its shards carry item records; else None
    (written by OLMo-core, plain DCP or trainckpt 0.1: not checked item by item)."""
    save_id = getattr(metadata.storage_meta, "save_id", None)
    if isinstance(save_id, str) and save_id.startswith(shard_checksums.SAVE_ID_PREFIX):
        return save_id
    log.info(
        "'%s' has no item records (written by OLMo-core, plain DCP or trainckpt 0.1): its "
        "shards are loaded without checking each item's CRC32C",
        folder,
    )
    return None


class _SafeLoadPlanner(DefaultLoadPlanner):
    """Loads non-tensor values with `safe_unpickle.load_torch_plain` (PyTorch's `weights_only`
    loader plus plain numpy values); `folder` names the checkpoint in its errors.

    Plans as DCP does, with less work per entry: the state is not copied to flatten
    `ShardedTensor`s when it holds none, and a value that needs no resharding gets its read
    item directly (`_whole_read_item`), not through DCP's general overlap search."""

    _mappings: dict[str, tuple[str | int, ...]] | None
    """DCP's mappings, or None until first read after the one-pass flattening."""

    def __init__(self, folder: str = "", direct: bool = False) -> None:
        """With `direct`, values that need no resharding are not put in the plan as read
        items but listed in `direct_items`: only a reader that loads those (`ParallelReader`)
        may be given such a planner."""
        super().__init__()
        self.folder = folder
        self.parsed = plain_values.Parsed()
        self.direct = direct
        self.direct_items: list[tuple[str, torch.Tensor | None]] = []
        """(name, the whole plain tensor to copy into, or None for a byte value)."""
        self._slots: dict[str, tuple[dict[str, Any], str]] = {}
        self._paths: tuple[dict[str, Any], _Runs] = ({}, [])
        self._dicts: list[str] | None = None
        """The flat path of every dict in the state (`_flat_plain`); None: DCP flattened it."""

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        flat = _flat_plain(state_dict) if self.flatten_state_dict else None
        if flat is None:  # DCP's way: meta tensors, DTensors, lists, ...
            self._slots = {}
            self._dicts = None
            self.flatten_sharded_tensors = _holds_sharded_tensor(state_dict)
            super().set_up_planner(state_dict, metadata, is_coordinator)
            return
        # What DCP's `set_up_planner` makes of such a state, in one pass over it; DCP's
        # `mappings` (a path per entry) only on first use (`mappings`)
        self.original_state_dict = state_dict
        self.state_dict, runs, self._slots, self._dicts = flat
        self._mappings = None
        self._paths = (self.state_dict, runs)
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    @property  # type: ignore[override]
    def mappings(self) -> dict[str, tuple[str | int, ...]]:
        """DCP's flat key -> path of the state being loaded. After the one-pass flattening
        (`_flat_plain`) it is made on first use: a load of a whole plain state never reads
        it (values go to their `_slots`), and making it was a tuple and an insertion into a
        dict of every entry (hundreds of thousands at 64,000 entries, each a cache miss)."""
        if self._mappings is None:
            self._mappings = _flat_paths(*self._paths)
        return self._mappings

    @mappings.setter
    def mappings(self, value: dict[str, tuple[str | int, ...]]) -> None:
        self._mappings = value

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        self.direct_items = []
        if self._older_keys(saved):
            self._slots = {}  # DCP may flatten anew, as PyTorch 2.3 did
            return super().create_local_plan()
        strict = not self.allow_partial_load
        items: list[ReadItem] = []
        append = items.append
        byte_io = LoadItemType.BYTE_IO
        get = saved.get
        direct: list[tuple[str, torch.Tensor | None]] = []
        self.direct_items = direct
        add_direct = direct.append if self.direct else None
        tensors = _PLAIN_TENSORS
        for fqn, obj in self.state_dict.items():
            md = get(fqn)
            kind = type(md)
            if kind is BytesStorageMetadata:  # most entries of an optimizer's state
                if add_direct is not None:
                    add_direct((fqn, None))
                    continue
                index = MetadataIndex(fqn)
                append(ReadItem(byte_io, index, _NO_OFFSET, index, _NO_OFFSET, _NO_OFFSET))
                continue
            if add_direct is not None:
                # `_whole_tensor`, inline (one call per tensor entry was a tenth of planning)
                if kind is TensorStorageMetadata and type(obj) in tensors:
                    chunks = md.chunks  # type: ignore[union-attr]
                    if len(chunks) == 1:
                        size = obj.size()
                        chunk = chunks[0]
                        if (
                            md.size == size  # type: ignore[union-attr]
                            and chunk.sizes == size
                            and not any(chunk.offsets)
                            and all(size)
                        ):
                            add_direct((fqn, obj))
                            continue
                elif _whole_tensor(md, obj):  # a subclass of the metadata's class
                    add_direct((fqn, obj))
                    continue
            item = _whole_read_item(fqn, md, obj)
            if item is not None:
                append(item)
            else:
                items.extend(_resharded_read_items(fqn, md, obj, self.metadata, strict))
        return LoadPlan(items)

    def _older_keys(self, saved: dict[str, Any]) -> bool:
        """Whether DCP might take the checkpoint for one of PyTorch 2.3 or older (whose keys
        end at a dict holding no tensor) and flatten the state anew, as its
        `create_local_plan` does when a saved key is not in the state and is a key of that
        older flattening. After `_flat_plain`, only a dict's path can be such a key, so that
        is all this looks up (a handful, not every saved key: a state may leave out many,
        as `ModelAndOptim` leaves out hyperparameters that loading does not read)."""
        if self._dicts is None:
            return not saved.keys() <= self.state_dict.keys()
        return any(path in saved for path in self._dicts)

    def direct_read_item(self, fqn: str, target: torch.Tensor | None) -> ReadItem:
        """The read item DCP would have planned for an entry of `direct_items` (for a reader
        that has to load it DCP's way: an unchecked or transformed item)."""
        assert self.metadata is not None
        item = _whole_read_item(fqn, self.metadata.state_dict_metadata[fqn], target)
        assert item is not None  # `direct_items` holds only such entries
        return item

    def commit_direct(self, fqn: str, tensor: torch.Tensor) -> None:
        """`commit_tensor` for an entry of `direct_items`, once its tensor is loaded."""

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        """The whole plain tensor a read item of `_whole_read_item` names, directly (what DCP's
        lookup and narrowing return for it); anything else through DCP."""
        index = read_item.dest_index
        obj: Any = self.state_dict.get(index.fqn)
        if (
            type(obj) in _PLAIN_TENSORS
            and index.offset is not None
            and not any(index.offset)
            and read_item.lengths == obj.size()
            and not any(read_item.dest_offsets)
        ):
            return obj  # type: ignore[no-any-return]
        return super().resolve_tensor(read_item)  # type: ignore[no-any-return]

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.load_plain(read_item, value.read())

    def load_plain(self, read_item: ReadItem, data: bytes) -> None:
        """`load_bytes` given the item's bytes (the reader calls it when the planner has it:
        no `io.BytesIO` per item)."""
        self.load_plain_value(read_item.dest_index.fqn, data)

    def load_plain_value(self, fqn: str, data: bytes) -> None:
        """Put the plain value saved in `data` (its bytes checked) under the flat key `fqn`."""
        self.load_plain_values([([fqn], data)])

    def load_plain_values(self, values: list[tuple[list[str], bytes]]) -> None:
        """`load_plain_value` for each (flat keys, checked bytes) of `values`: what the reader
        hands on for the byte values of `direct_items`, a span of them at a time, the values
        stored at one place together (an optimizer's tens of thousands of hyperparameters are
        a few dozen places). Each distinct item is parsed once by the safe parser, and its
        value shared by every key when it is immutable (`plain_values.Parsed`); a mutable one
        is parsed for each key."""
        lookup, missing, slots = self.parsed.lookup, plain_values.MISSING, self._slots.get
        for names, data in values:
            shared = lookup(data, missing)
            for fqn in names:
                obj = shared
                if obj is missing:
                    obj = self.parsed.value(data, partial(self._parse, fqn))
                    shared = lookup(data, missing)  # kept if immutable: the other keys' too
                slot = slots(fqn)  # empty unless `flatten_state_dict`
                if slot is not None:
                    slot[0][slot[1]] = obj
                else:
                    self._set_plain(fqn, obj)

    def _parse(self, fqn: str, data: bytes) -> Any:
        return load_torch_plain(data, f"DCP value '{fqn}' in '{self.folder}'")

    def _set_plain(self, fqn: str, obj: Any) -> None:
        """Put `obj` under the flat key `fqn` of a state without `_slots` for it."""
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        path = self.mappings[fqn]
        try:  # the state to load into has every container on the path already
            parent: Any = self.original_state_dict
            for key in path[:-1]:
                parent = parent[key]
            parent[path[-1]] = obj
        except (KeyError, IndexError, TypeError):
            set_element(self.original_state_dict, path, obj)


_PLAIN_LEAVES = frozenset({int, float, bool, str, bytes, complex, tuple, type(None)})


_Slots = dict[str, tuple[dict[str, Any], str]]
"""For each flat key, the dict that holds its value and the key there."""

_Runs = list[tuple[tuple[str, ...], int, int]]
"""The flat keys in runs of one dict's values: (the dict's path, the length of its flat
prefix, the index of the run's first flat key). DCP's mappings follow from them
(`_flat_paths`)."""


def _flat_plain(
    state: dict[str, Any],
) -> tuple[dict[str, Any], _Runs, _Slots, list[str]] | None:
    """What DCP's flattening (`flatten_state_dict`) makes of `state`, when `state` is nested
    plain dicts with string keys down to whole CPU/GPU tensors (`torch.Tensor` or `Parameter`,
    not on the meta device) and plain values (`_PLAIN_LEAVES`): the flat state, the runs that
    make DCP's mappings (flat key -> path; `_flat_paths`), for each flat key the dict and
    key that hold it, and the flat path of every nested dict. None for anything else
    (DTensors, ShardedTensors, lists, meta tensors, non-string keys, two paths with one flat
    key): DCP then flattens it, and raises its errors. One pass, no per-entry calls: at
    tens of thousands of entries, DCP's traversal was a tenth of a load."""
    if type(state) is not dict or _version._derived_version is not None:
        return None
    flat: dict[str, Any] = {}
    runs: _Runs = []
    slots: _Slots = {}
    dicts: list[str] = []
    tensors = _PLAIN_TENSORS
    leaves = _PLAIN_LEAVES
    # Depth first, in each dict's order (DCP's order), with a stack rather than a recursive
    # closure: such a closure is a reference cycle that kept every path and slot (two tuples
    # per entry) alive until the collector ran, which then cost a fifth of a load.
    stack: list[tuple[Iterator[tuple[Any, Any]], dict[str, Any], tuple[str, ...], str]] = [
        (iter(state.items()), state, (), "")
    ]
    depth = 0
    last: dict[str, Any] | None = None  # the dict of the last run
    while stack:
        items, d, path, prefix = stack[-1]
        for key, value in items:
            if type(key) is not str:
                return None
            kind = type(value)
            if kind is dict:
                depth += 1
                if depth > _MAX_DEPTH:
                    return None
                dicts.append(prefix + key)
                stack.append((iter(value.items()), value, (*path, key), f"{prefix}{key}."))
                break
            if kind in tensors:
                if value.is_meta:
                    return None
            elif kind not in leaves:
                return None
            fqn = prefix + key
            if fqn in flat:
                return None
            if d is not last:
                runs.append((path, len(prefix), len(flat)))
                last = d
            flat[fqn] = value
            slots[fqn] = (d, key)
        else:
            stack.pop()
            depth -= 1
    return flat, runs, slots, dicts


def _flat_paths(flat: dict[str, Any], runs: _Runs) -> dict[str, tuple[str | int, ...]]:
    """DCP's mappings (flat key -> the path of keys to its value) of a state that
    `_flat_plain` walked into `flat` and `runs`: each key is its run's path plus what
    follows the run's flat prefix."""
    keys = list(flat)
    mappings: dict[str, tuple[str | int, ...]] = {}
    starts = [start for _, _, start in runs]
    for (path, cut, start), stop in zip(runs, [*starts[1:], len(keys)], strict=False):
        for fqn in keys[start:stop]:
            mappings[fqn] = (*path, fqn[cut:])
    return mappings


_MAX_DEPTH = 900
"""Nesting beyond this goes through DCP's flattening (which recurses), as it did when this
walk recursed too."""


def _holds_sharded_tensor(state: Any) -> bool:
    """Whether the nested state `state` holds a `ShardedTensor` anywhere."""
    stack = [state]
    while stack:
        obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, ShardedTensor):
            return True
        elif isinstance(obj, Mapping):
            stack.extend(obj.values())
    return False


_NO_OFFSET = torch.Size((0,))


def _whole_read_item(fqn: str, saved: Any, obj: Any) -> ReadItem | None:
    """The read item DCP plans for `obj` under `fqn` when it needs no resharding: a byte
    value, or a plain tensor with no empty dimension saved whole, in one chunk of its size.
    One `MetadataIndex` serves as destination and storage index (they are equal). None for
    anything else (DCP plans it, and raises its errors)."""
    if isinstance(saved, BytesStorageMetadata):
        index = MetadataIndex(fqn)
        return ReadItem(LoadItemType.BYTE_IO, index, _NO_OFFSET, index, _NO_OFFSET, _NO_OFFSET)
    if not _whole_tensor(saved, obj):
        return None
    zeros = saved.chunks[0].offsets
    index = MetadataIndex(fqn, zeros, 0)
    return ReadItem(LoadItemType.TENSOR, index, zeros, index, zeros, obj.size())


def _resharded_read_items(
    fqn: str, saved: Any, obj: Any, metadata: Metadata, strict: bool
) -> list[ReadItem]:
    """DCP's read items for one entry that needs resharding (`create_default_local_load_plan`),
    found in trainckpt's own metadata's chunk table where it keeps the tensor's chunks there
    (`native_metadata.read_items`: a rank's shard of a tensor saved by thousands of ranks
    overlaps a few of their chunks); through DCP for anything else, and for every case DCP
    refuses (a size that differs, an object that is no tensor), so that it raises its errors."""
    if (
        isinstance(saved, TensorStorageMetadata)
        and isinstance(obj, torch.Tensor)
        and saved.size == obj.size()
        and not (isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None)
    ):
        found = native_metadata.read_items(fqn, saved, _create_chunk_list(obj))
        if found is not None:
            return found
    return create_default_local_load_plan({fqn: obj}, metadata, strict).items


def _whole_tensor(saved: Any, obj: Any) -> bool:
    """Whether `obj` is a plain tensor with no empty dimension that `saved` holds whole, in
    one chunk of its size (loaded by one copy of that chunk, with no resharding)."""
    if (
        not isinstance(saved, TensorStorageMetadata)
        or type(obj) not in _PLAIN_TENSORS
        or len(saved.chunks) != 1
    ):
        return False
    size, chunk = obj.size(), saved.chunks[0]
    return bool(saved.size == size and chunk.sizes == size and not any(chunk.offsets) and all(size))


def load_state(
    state: dict[str, Any],
    storage: Storage,
    folder: str,
    metadata: Metadata,
    *,
    group: dist.ProcessGroup | None,
    download_to: Path | None = None,
    thread_count: int = 4,
    check_items: bool = True,
) -> None:
    """Fill `state` in place from the DCP folder `folder`. With `download_to`, the shard files
    this rank needs are first downloaded there (`pre_download`), on `thread_count` threads.
    With `check_items`, each shard must name itself and the save in `metadata`, and each item
    loaded must have the CRC32C it was written with (`CorruptCheckpointError` naming the file).

    Called on: all ranks (DCP plans collectively).
    """
    what = f"loading DCP state from '{folder}'"
    with paused_gc(), _quiet_single_process(), plain_errors(what, CheckpointError):
        dcp.load(
            state,
            storage_reader=_SafeReader(
                storage, folder, metadata, download_to, thread_count, check_items
            ),
            planner=_SafeLoadPlanner(folder, direct=True),
            process_group=group,
            no_dist=dist.get_world_size(group) == 1,  # DCP's collectives pickle every plan
        )


class _ProgressLoadPlanner(_SafeLoadPlanner):
    """`_SafeLoadPlanner` that reports the bytes of every tensor piece it has loaded."""

    def __init__(self, progress: Callable[[int], None], folder: str) -> None:
        super().__init__(folder, direct=True)
        self._progress = progress

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self._progress(tensor.numel() * tensor.element_size())

    def commit_direct(self, fqn: str, tensor: torch.Tensor) -> None:
        self._progress(tensor.numel() * tensor.element_size())


def load_full_state(
    storage: Storage,
    folder: str,
    metadata: Metadata,
    *,
    keys_prefix: str = "",
    progress: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Every value of the DCP folder `folder` whose key starts with `keys_prefix`, as one flat
    dict of full (unsharded) CPU tensors and plain values, keyed by DCP's flattened names.

    Consolidates a sharded checkpoint in one process without a process group: the empty
    tensors are built from `metadata`, then filled by the safe reader. `progress` receives the
    byte count of each loaded tensor piece (they add up to the tensors' total size).
    """
    state: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if not key.startswith(keys_prefix):
            continue
        if isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
        else:
            state[key] = None  # a non-tensor value; the planner sets it
    if not state:
        return state
    planner = (
        _SafeLoadPlanner(folder, direct=True)
        if progress is None
        else _ProgressLoadPlanner(progress, folder)
    )
    what = f"loading DCP state from '{folder}'"
    with paused_gc(), _quiet_single_process(), plain_errors(what, CheckpointError):
        dcp.load(
            state,
            storage_reader=_SafeReader(storage, folder, metadata),
            planner=planner,
            no_dist=True,
        )
    return state


@contextmanager
def _quiet_single_process() -> Generator[None, None, None]:
    """DCP warns on every single-process call that it assumes a single process; it is right."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextmanager
def plain_errors(what: str, fallback: type[CheckpointError]) -> Generator[None, None, None]:
    """DCP reports failures as `CheckpointException`, a `BaseException` that `except Exception`
    (and so a trainer's error handling) misses. Re-raise our own error found inside it, else
    wrap the first failure in `fallback`, naming the ranks and what failed."""
    try:
        yield
    except CheckpointException as e:
        failures = [exc for exc, _trace in e.failures.values()]
        ours = next((f for f in failures if isinstance(f, CheckpointError)), None)
        if ours is not None:
            raise ours from e
        first = failures[0] if failures else e
        raise fallback(
            f"{what} failed on rank(s) {sorted(e.failures)}: {type(first).__name__}: {first}. "
            "If the model matches the checkpoint, check the checkpoint's files with "
            "Checkpointer.verify(path, deep=True)"
        ) from first
