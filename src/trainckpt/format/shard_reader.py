"""The read loop of `torch.distributed.checkpoint` (DCP), on several threads.

DCP's `FileSystemReader.read_data` reads every item of every shard one after the other on the
calling thread: the disk waits while a tensor is deserialized and copied, and the copy waits
while the disk reads. Here the items are split into contiguous runs of about equal size, one per
thread, each thread with its own file handles; reading, `torch.load(weights_only=True)` and the
copy into the target release the GIL. The planner is only called under a lock. The number of
threads follows the large items to read (`reading_threads`): small items are mostly work under
the interpreter lock, which more threads only fight over.

Given the id of the save that wrote the checkpoint (`save_id`, from `.metadata`), every shard
file this rank reads has its item record read and checked first (it must name that file and that
save), before any item is loaded. Neighbouring items of one file are then read together, in one
read (`_spans`), and each item's bytes are checked against their recorded CRC32C in memory,
before they are deserialized (`shard_checksums`); the tensor is then built on those checked
bytes in place (`_load_checked`), so a checked load copies each byte as often as an unchecked
one: from the file into memory, from memory into the model. A whole tensor stored packed goes
into a contiguous CPU target of its dtype and shape by one `memmove` (`_copy_into`). A small
byte value whose bytes equal those of one already checked against the same recorded length
and CRC32C is checked by that comparison (equal bytes have equal CRC32Cs).
"""

from __future__ import annotations

import ctypes
import io
import math
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import IO, Any, TypeVar, cast

import google_crc32c
import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from trainckpt.format import shard_checksums
from trainckpt.format.tensor_flags import flips_values
from trainckpt.identity import identity
from trainckpt.storage.ranged import RangeReader

# A reading thread pays off only for large items: the work per item (planning, checking,
# building the tensor, ~0.1 ms) holds the interpreter lock, so threads reading small items
# mostly wait for one another (a 16,000-entry state, 60,000 items of ~1.5 KB, loaded ~1.5x
# slower on 4 threads than on one). An item of `LARGE_ITEM_BYTES` takes about as long to
# read, check and copy, without the lock; a thread per `BYTES_PER_THREAD` of such items.
LARGE_ITEM_BYTES = 256 * 2**10
BYTES_PER_THREAD = 16 * 2**20
# Checked items of one file are read together, in one read of up to this many bytes (an item
# larger than that is read alone), skipping gaps of up to `_MAX_GAP` bytes between them.
_SPAN_BYTES = 4 * 2**20
_MAX_GAP = 64 * 2**10
# Below this many bytes, an item's CRC32C is one call on a copy of it (`shard_checksums.crc32c`)
_SMALL_CRC = 2**20
# Byte values a reading thread keeps after checking them, to check equal ones by comparison
# (`ParallelReader._read_run`): up to this many, of up to this many bytes each.
_CHECKED_COUNT = 4096
_CHECKED_BYTES = 4096

_Work = tuple[_StorageInfo, ReadItem]  # or a direct item: (name, tensor), (names, None)
_T = TypeVar("_T")


def reading_threads(lengths: Iterable[int], thread_count: int) -> int:
    """How many of `thread_count` threads read items of `lengths` bytes: one per
    `BYTES_PER_THREAD` of the items of at least `LARGE_ITEM_BYTES`, and at least one."""
    large = sum(n for n in lengths if n >= LARGE_ITEM_BYTES)
    return max(1, min(thread_count, large // BYTES_PER_THREAD))


class ParallelReader(FileSystemReader):
    """DCP's file reader with up to `thread_count` reading threads; same files, same results."""

    # Any of DCP's file systems (DCP declares the local one): ours serves remote storage too.
    fs: FileSystemBase  # type: ignore[assignment]

    def __init__(self, path: Any, thread_count: int = 4, save_id: str | None = None) -> None:
        """With `save_id`, every shard's item record and every item's CRC32C are checked."""
        super().__init__(path)
        self.thread_count = max(1, thread_count)
        self.save_id = save_id

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        """DCP's, but trainckpt's own metadata's `storage_data` is left unbuilt until an item
        needs it: whole entries are found by name in its `pieces`."""
        self._pieces: dict[str, _StorageInfo] | None = getattr(metadata, "pieces", None)
        if getattr(metadata, "storage_built", True):
            self._unbuilt: Metadata | None = None
            super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
            return
        self._unbuilt = metadata
        self.rank = kwargs.get("rank")
        self.use_collectives = kwargs.get("use_collectives", True)

    def storage(self) -> dict[MetadataIndex, _StorageInfo]:
        """`storage_data`, built on first use (`set_up_storage_reader`)."""
        unbuilt = getattr(self, "_unbuilt", None)
        if unbuilt is not None:
            self.storage_data, self._unbuilt = unbuilt.storage_data, None
            if self.storage_data is None:
                raise AssertionError("storage_data must not be None in metadata")
        return self.storage_data

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        work: list[_Work] = []
        if plan.items:
            storage = self.storage()
            work = [(storage[req.storage_index], req) for req in plan.items]
        work += self._direct_work(planner)
        work, names = _in_place_order(work)
        records = self._records(sorted(names))
        threads = reading_threads([info.length for info, _ in work], self.thread_count)
        runs = _split_runs(work, threads, lambda w: w[0].length)
        lock = threading.Lock()
        self._run_all(lambda run: self._read_run(run, planner, lock, records), runs, threads)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _direct_work(self, planner: LoadPlanner) -> list[_Work]:
        """The planner's `direct_items` (entries loaded whole, planned without read items:
        `core/dcp.py`), each with its stored piece, found by name (an entry there has one
        piece). Byte values stored at one place (one `_StorageInfo`: an optimizer's tens of
        thousands of equal hyperparameters) are one piece of work, `(their names, None)`: read
        and checked once, not sorted and walked one by one. Items that are not checked item by
        item, or that a storage extension transformed, get their read item from the planner
        and are loaded DCP's way."""
        direct: list[tuple[str, torch.Tensor | None]] = getattr(planner, "direct_items", [])
        if not direct:
            return []
        known = getattr(self, "_pieces", None)
        if known is not None:  # trainckpt's metadata: one piece per byte value or chunk
            get = known.get
        else:
            pieces: dict[str, Any] = {}
            for key, info in self.storage().items():
                name = key.fqn
                if name in pieces:  # an entry with several pieces is never direct
                    pieces[name] = None
                elif key.offset is None or not any(key.offset):
                    pieces[name] = info
                else:
                    pieces[name] = None
            get = pieces.get
        work: list[_Work] = []
        append = work.append
        as_read_item = planner.direct_read_item  # type: ignore[attr-defined]
        checked = self.save_id is not None
        places: dict[int, tuple[_StorageInfo, list[str]]] = {}  # by the piece (`identity`)
        for entry in direct:
            fqn, target = entry
            info = get(fqn)
            if info is None:
                raise ValueError(f"the checkpoint has no single stored piece of '{fqn}'")
            if not checked or info.transform_descriptors:
                append((info, as_read_item(fqn, target)))
            elif target is not None:
                append((info, entry))  # type: ignore[arg-type]
            else:
                place = places.get(identity(info))
                if place is None:
                    places[identity(info)] = (info, [fqn])
                else:
                    place[1].append(fqn)
        work += [(info, (names, None)) for info, names in places.values()]  # type: ignore[misc]
        return work

    def _run_all(self, fn: Callable[[Any], None], work: list[Any], threads: int) -> None:
        """`fn` on each piece of `work`, on up to `threads` threads; the first error raises."""
        if len(work) <= 1 or threads <= 1:
            for piece in work:
                fn(piece)
            return
        with ThreadPoolExecutor(
            min(threads, len(work)), thread_name_prefix="trainckpt-read"
        ) as pool:
            for future in [pool.submit(fn, piece) for piece in work]:
                future.result()

    def _records(self, names: list[str]) -> dict[str, shard_checksums.ItemRecord]:
        """The item record of each shard file `names`, each checked to name that file and this
        save; none without a `save_id`. Read before any item, so a misplaced file stops the
        load before any tensor reaches the model."""
        records: dict[str, shard_checksums.ItemRecord] = {}
        if self.save_id is None:
            return records
        save_ids = shard_checksums.save_ids(self.save_id)

        def read(name: str) -> None:
            path = str(self.fs.concat_path(self.path, name))
            with self.fs.create_stream(path, "rb") as stream:
                record = shard_checksums.read(stream, path)
            record.check_identity(path, name, save_ids)
            records[name] = record

        self._run_all(read, names, self.thread_count)  # one small read each: waits, not work
        return records

    def _read_run(
        self,
        run: list[_Work],
        planner: LoadPlanner,
        lock: threading.Lock,
        records: dict[str, shard_checksums.ItemRecord],
    ) -> None:
        """Load the items of `run`: checked items span by span (one read, then each item's
        CRC32C checked on its slice before it is used), unchecked ones one by one.

        Per item, the least Python that keeps every check: the CRC32C is compared inline
        (`ItemRecord.check_item` runs only to name a mismatch), and a plain value goes to the
        planner's `load_plain` as bytes where it has one (no file object per item). The byte
        values of the planner's `direct_items` go to its `load_plain_values`, a span's at once."""
        buffer = _ItemBuffer()
        load_plain: Callable[[ReadItem, bytes], None] | None = getattr(planner, "load_plain", None)
        plain_values: Callable[[list[tuple[list[str], bytes]]], None] | None = getattr(
            planner, "load_plain_values", None
        )
        commit_direct: Callable[[str, torch.Tensor], None] | None = getattr(
            planner, "commit_direct", None
        )
        byte_io = LoadItemType.BYTE_IO
        crc32c = shard_checksums.crc32c
        value = google_crc32c.value
        small = _SMALL_CRC
        match = _SKELETONS.match
        into = _copy_into
        # Byte values already checked, by their record entry (length, CRC32C): an item whose
        # bytes equal those is checked without computing its CRC32C again, and is handed on
        # as that same bytes object (the planner's parse cache then finds it without hashing
        # its bytes again). Bounded: thousands of hyperparameters, mostly equal.
        checked_bytes: dict[tuple[int, int], bytes] = {}
        seen = checked_bytes.get
        with ExitStack() as stack:
            stack.enter_context(torch.no_grad())  # direct copies into parameters
            streams: dict[str, tuple[Any, str]] = {}
            for span, end in _spans(run):
                name = span[0][0].relative_path
                if name not in streams:
                    path = str(self.fs.concat_path(self.path, name))
                    streams[name] = (stack.enter_context(self.fs.create_stream(path, "rb")), path)
                stream, path = streams[name]
                record = records.get(name)
                if record is None:
                    for info, req in span:
                        self._read_item(req, info, self._slice_file(stream, info), planner, lock)
                    continue
                start = span[0][0].offset
                whole = _StorageInfo(name, start, end - start)
                got = buffer.read(self._slice_file(stream, whole), end - start)
                data = memoryview(got)
                address = buffer.address(got)  # where `data` is, if in the thread's buffer
                base = buffer.whole(got)  # `base.startswith(b, at)`: `data[at:]` vs `b`
                size = len(data)
                listed = record.items.get
                values: list[tuple[list[str], bytes]] = []  # the span's byte values, at once
                add_values = values.append
                for info, req in span:
                    offset, length = info.offset, info.length
                    at = offset - start
                    if type(req) is tuple:  # the planner's `direct_items`: checked, whole
                        expected = listed(offset)
                        if req[1] is None:  # (names, None): byte values stored at this place
                            names = req[0]
                            same = seen(expected)  # type: ignore[arg-type]
                            if (
                                same is not None
                                and base is not None
                                and len(same) == length
                                and at + length <= size  # not the reused buffer's old bytes
                                and base.startswith(same, at)
                            ):  # the bytes of an item that had this CRC32C, compared in place
                                add_values((names, same))
                                continue
                            raw = data[at : at + length].tobytes()
                            if same is not None and same == raw:
                                raw = same  # the bytes of an item that had this CRC32C
                            else:
                                crc = crc32c(raw) if length >= small else value(raw)
                                if expected != (length, crc):
                                    record.check_item(
                                        path, offset, data[at : at + length], f"item '{names[0]}'"
                                    )
                                    raise AssertionError("unreachable: the check above raises")
                                if length <= _CHECKED_BYTES and len(checked_bytes) < _CHECKED_COUNT:
                                    checked_bytes[expected] = raw  # type: ignore[index]
                            add_values((names, raw))
                            continue
                        fqn, target = req
                        item = data[at : at + length]
                        crc = crc32c(item) if length >= small else value(item.tobytes())
                        if expected != (length, crc):
                            record.check_item(path, offset, item, f"item '{fqn}'")
                            raise AssertionError("unreachable: the check above raises")
                        skeleton = match(item) if address is not None else None
                        if skeleton is None or not into(skeleton, target, address + at):  # type: ignore[operator]
                            tensor = _load_checked(item)
                            if target.size() != tensor.size():
                                raise ValueError(
                                    f"item {fqn}: the checkpoint holds shape "
                                    f"{tuple(tensor.size())}, the state to load into has "
                                    f"{tuple(target.size())}"
                                )
                            target.copy_(tensor)
                        with lock:
                            commit_direct(fqn, target)  # type: ignore[misc]
                        continue
                    item = data[at : at + length]
                    plain = (
                        load_plain is not None
                        and req.type is byte_io
                        and not info.transform_descriptors
                    )
                    raw = item.tobytes() if plain else item  # a plain value is kept as bytes
                    if listed(offset) != (length, crc32c(raw)):
                        record.check_item(path, offset, item, f"item '{req.storage_index.fqn}'")
                        raise AssertionError("unreachable: the check above raises")
                    if plain:
                        with lock:
                            load_plain(req, raw)  # type: ignore[misc, arg-type]
                    else:
                        self._read_item(req, info, None, planner, lock, item)
                if values:
                    with lock:
                        plain_values(values)  # type: ignore[misc]

    def _read_item(
        self,
        req: ReadItem,
        info: _StorageInfo,
        file_slice: IO[bytes] | None,
        planner: LoadPlanner,
        lock: threading.Lock,
        checked: memoryview | None = None,
    ) -> None:
        """Load one item into the planner's target, from `file_slice`, or from `checked`, its
        bytes already checked."""
        data = file_slice if checked is None else None
        if info.transform_descriptors:  # a storage extension transformed it
            source = _in_memory(checked) if checked is not None else file_slice
            assert source is not None
            data = self.transforms.transform_load_stream(req, info.transform_descriptors, source)
        if req.type == LoadItemType.BYTE_IO:
            raw = io.BytesIO(data.read(-1) if data is not None else cast(memoryview, checked))
            with lock:
                planner.load_bytes(req, raw)
            return
        if data is None:
            tensor = _load_checked(cast(memoryview, checked))
        else:
            seekable = data if data.seekable() else io.BytesIO(data.read(-1))
            tensor = torch.load(seekable, map_location="cpu", weights_only=True)
        if req.lengths != tensor.size():  # a piece of the stored tensor
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


def _in_place_order(work: list[_Work]) -> tuple[list[_Work], set[str]]:
    """`work` in the order of the files and the offsets of its items (a stable sort), and
    the names of those files. The sort keys are made in one pass and looked up by index:
    a key function per item was a tenth of the reader's preparation at 60,000 items."""
    infos = [info for info, _ in work]
    names = {info.relative_path for info in infos}
    if len(names) <= 1:  # one shard file (one rank's save)
        keys: list[Any] = [info.offset for info in infos]
    else:
        keys = [(info.relative_path, info.offset) for info in infos]
    order = sorted(range(len(work)), key=keys.__getitem__)
    return [work[i] for i in order], names


def _spans(run: list[_Work]) -> Iterator[tuple[list[_Work], int]]:
    """`run` (sorted by file and offset) cut into spans, each read with one read: items of
    one file at most `_MAX_GAP` bytes apart, at most `_SPAN_BYTES` from the first item's
    start to the last one's end (or a single item). Each with the offset where it ends."""
    span: list[_Work] = []
    name, start, end = "", 0, 0
    for work in run:
        info = work[0]
        offset = info.offset
        stop = offset + info.length
        if span and (
            offset > end + _MAX_GAP
            or (stop if stop > end else end) - start > _SPAN_BYTES
            or info.relative_path != name
        ):
            yield span, end
            span = []
        if not span:
            name, start, end = info.relative_path, offset, offset
        span.append(work)
        if stop > end:
            end = stop
    if span:
        yield span, end


def _load_checked(data: bytes | memoryview) -> torch.Tensor:
    """The tensor `torch.save`d in `data`, on the CPU, its storage the bytes of `data` (no copy:
    valid while `data` is). `torch.load(weights_only=True)` onto the meta device reads only the
    pickle (shape, strides, dtype, and where in `data` the storage's bytes start); the tensor is
    then a view of those bytes. Anything else (a read-only buffer, bytes in the other byte
    order, a storage past the end of `data`, a lazily conjugated or negated tensor) is loaded
    by `torch.load` into its own memory.

    An item whose bytes outside its storage equal those of an item read before (`_SKELETONS`)
    is the same kind of tensor at the same place: it is built from what that one's pickle said,
    without reading its own (thousands of small tensors cost microseconds each, not ~0.5 ms)."""
    view = memoryview(data)
    if not view.readonly:
        known = _SKELETONS.match(view)
        if known is not None:
            return known.build(view)
    meta = torch.load(_in_memory(data), map_location="meta", weights_only=True)
    storage = meta.untyped_storage()
    offset = getattr(storage, "_checkpoint_offset", None)
    nbytes = storage.nbytes()
    view = memoryview(data)
    if (
        type(meta) is not torch.Tensor
        or meta.layout != torch.strided
        or meta.is_quantized
        or flips_values(meta)  # torch.save keeps the bit: the storage does not hold the values
        or not isinstance(offset, int)
        or nbytes == 0
        or offset < 0
        or offset + nbytes > len(view)
        or view.readonly  # torch.frombuffer wants a writable buffer (it never writes here)
        or _byteorder(data) != sys.byteorder
    ):
        return torch.load(_in_memory(data), map_location="cpu", weights_only=True)
    skeleton = _Skeleton(
        view, offset, nbytes, meta.dtype, meta.size(), meta.stride(), int(meta.storage_offset())
    )
    _SKELETONS.learn(skeleton)
    return skeleton.build(view)


class _Skeleton:
    """What an item's pickle says (storage at `offset`, `nbytes` long, and the tensor's dtype,
    shape, strides and storage offset), and the item's bytes outside its storage, which fix
    all of that: any item with the same bytes there is read the same way."""

    def __init__(
        self,
        item: memoryview,
        offset: int,
        nbytes: int,
        dtype: torch.dtype,
        size: torch.Size,
        stride: tuple[int, ...],
        storage_offset: int,
    ) -> None:
        self.length = len(item)
        self.offset, self.nbytes = offset, nbytes
        self.head = bytes(item[:offset])
        self.tail = bytes(item[offset + nbytes :])
        self.dtype, self.size, self.stride = dtype, size, stride
        self.storage_offset = storage_offset
        # Where in the item the tensor's elements start, when they are stored packed in
        # row-major order (the layout of a contiguous tensor of `size`), else None
        itemsize = dtype.itemsize
        self.packed_bytes = math.prod(size) * itemsize
        contiguous, step = [], 1
        for n in reversed(size):
            contiguous.append(step)
            step *= n
        start = storage_offset * itemsize
        self.packed: int | None = (
            offset + start
            if tuple(stride) == tuple(reversed(contiguous))
            and not dtype.is_complex  # a conjugate view would be copied conjugated
            and 0 < self.packed_bytes
            and start + self.packed_bytes <= nbytes
            else None
        )

    def matches(self, item: memoryview) -> bool:
        return (
            len(item) == self.length
            and item[: self.offset].tobytes() == self.head  # memcmp, not item by item
            and item[self.offset + self.nbytes :].tobytes() == self.tail
        )

    def build(self, item: memoryview) -> torch.Tensor:
        flat = torch.frombuffer(item, dtype=torch.uint8, count=self.nbytes, offset=self.offset)
        return flat.view(self.dtype).as_strided(self.size, self.stride, self.storage_offset)


class _Skeletons:
    """The skeletons of items read so far, by item length: at most `PER_LENGTH` kinds per
    length (items whose zip entries carry a CRC32 of their data never match one another, so
    they are not collected one by one) and `LIMIT` in all, then it starts over. Thread-safe
    (a race only learns a kind twice)."""

    LIMIT = 4096
    PER_LENGTH = 4

    def __init__(self) -> None:
        self._by_length: dict[int, list[_Skeleton]] = {}
        self._count = 0

    def match(self, item: memoryview) -> _Skeleton | None:
        for skeleton in self._by_length.get(len(item), ()):
            if skeleton.matches(item):
                return skeleton
        return None

    def learn(self, skeleton: _Skeleton) -> None:
        if self._count >= self.LIMIT:
            self._by_length, self._count = {}, 0
        same = self._by_length.setdefault(skeleton.length, [])
        if len(same) < self.PER_LENGTH:
            same.append(skeleton)
            self._count += 1


_SKELETONS = _Skeletons()
_PLAIN_TARGETS = (torch.Tensor, torch.nn.Parameter)
_memmove = ctypes.memmove
_increment_version = torch.autograd.graph.increment_version


def _copy_into(skeleton: _Skeleton, target: torch.Tensor, address: int) -> bool:
    """Copy the tensor of a checked item at `address` in memory (laid out as `skeleton`
    says) into `target` by one `memmove` of its bytes, if that is exactly what
    `target.copy_` of it would do: a plain contiguous CPU tensor of the same dtype and
    shape, stored packed, not a negative view. Else False, and nothing was copied. Like
    `copy_`, it counts as a change of `target` for autograd (its version). Four calls
    instead of a tensor built on the bytes and copied (a quarter of a small item's time)."""
    packed = skeleton.packed
    if (
        packed is None
        or type(target) not in _PLAIN_TARGETS
        or target.dtype != skeleton.dtype
        or target.size() != skeleton.size
        or not target.is_cpu
        or not target.is_contiguous()
        or flips_values(target)
    ):
        return False
    _memmove(target.data_ptr(), address + packed, skeleton.packed_bytes)
    _increment_version(target)
    return True


def _byteorder(data: bytes | memoryview) -> str:
    """The byte order `torch.save` recorded in `data` (files without the record are
    little-endian, as `torch.load` assumes)."""
    reader = torch._C.PyTorchFileReader(_in_memory(data))
    if "byteorder" not in reader.get_all_records():
        return "little"
    return bytes(reader.get_record("byteorder")).decode()


class _ItemBuffer:
    """One reading thread's memory for the item being checked, reused from item to item (a
    fresh allocation per item would cost as much again as reading it: page faults)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pin: ctypes.c_char | None = None  # keeps `_buf` where `_address` says
        self._address = 0
        self._lent: memoryview | None = None

    def read(self, file_slice: IO[bytes], length: int) -> bytes | memoryview:
        """The `length` bytes of `file_slice`: remote ranged reads are in memory already."""
        self._lent = None
        if isinstance(file_slice, io.BytesIO):
            return file_slice.getvalue()  # no copy: an untouched BytesIO made from bytes
        if len(self._buf) < length:
            self._buf = bytearray(length)
            self._pin = ctypes.c_char.from_buffer(self._buf)  # the bytearray cannot move
            self._address = ctypes.addressof(self._pin)
        view = memoryview(self._buf)[:length]
        got = 0
        while got < length and (n := file_slice.readinto(view[got:])):  # type: ignore[attr-defined]
            got += n
        self._lent = view[:got]
        return self._lent

    def whole(self, data: bytes | memoryview) -> bytes | bytearray | None:
        """The bytes object whose first byte is `data`'s first, if `data` is what `read`
        returned last (or bytes): its `startswith(b, at)` compares `data[at:]` with `b`
        without copying it. Past `len(data)` it may hold older bytes (the buffer is reused
        from span to span): callers compare only within `len(data)`."""
        if data is self._lent:
            return self._buf
        return data if type(data) is bytes else None

    def address(self, data: bytes | memoryview) -> int | None:
        """The address in memory of the first byte of `data` if it is what `read` returned
        last from this buffer (writable memory), else None."""
        return self._address if data is self._lent and len(data) else None


def _in_memory(data: bytes | memoryview) -> IO[bytes]:
    """A seekable file over bytes in memory, without copying them (`io.BytesIO` would)."""
    view = memoryview(data)
    return cast(IO[bytes], RangeReader("<checked item>", len(view), lambda s, e: view[s:e]))


def _split_runs(items: list[_T], n: int, size: Callable[[_T], int]) -> list[list[_T]]:
    """`items` cut into at most `n` contiguous runs of about equal total size."""
    if n <= 1:
        return [items] if items else []
    total = sum(size(i) for i in items)
    runs: list[list[_T]] = [[]]
    filled = 0
    for item in items:
        if runs[-1] and len(runs) < n and filled >= total * len(runs) / n:
            runs.append([])
        runs[-1].append(item)
        filled += size(item)
    return [r for r in runs if r]
