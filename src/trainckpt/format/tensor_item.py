"""One tensor item of a shard file, as `torch.save` writes it minus the zip CRC32.

`save_item` serializes one tensor through `torch.save`'s own serializer with the CRC32 off;
`ItemTemplates` keeps the fixed head and tail of each kind of tensor seen, so the next tensors
of that kind are written as head + bytes + tail without serializing. Split from
`shard_writer.py` (which writes whole files): this is the byte-exact part, compared with
`torch.save`'s bytes by `tests/unit/test_shard_writer.py`. Called on: a writer thread of any
rank, or the writer process (`write_tensor`)."""

from __future__ import annotations

import contextlib
import ctypes
import io
import pickle
from typing import IO, cast

import torch
from torch.serialization import DEFAULT_PROTOCOL, _get_storage_alignment, _save

from trainckpt.format.content_hash import Kind, storage_bytes, tensor_kind
from trainckpt.format.tensor_flags import flips_values
from trainckpt.storage.checksummed_file import ChecksummedWriter


def write_tensor(tensor: torch.Tensor, out: ChecksummedWriter) -> None:
    """Write `tensor` as `save_item` would, from the process's templates when its kind
    allows one."""
    _TEMPLATES.write(tensor, out)


def save_item(tensor: torch.Tensor, out: ChecksummedWriter) -> None:
    """`torch.save(tensor, out)` without the zip CRC32 (`save_without_zip_crc`)."""
    save_without_zip_crc(tensor, out)


def save_without_zip_crc(obj: object, out: IO[bytes] | ChecksummedWriter) -> None:
    """`torch.save(obj, out)` without the zip CRC32 (a second pass over every byte; the
    file's CRC32C covers them): the same bytes as `torch.save` under `set_crc32_options(False)`.
    That option is not a safe switch here: in torch 2.13 it is a per-thread value (a
    ContextVar: set by the caller of a save, it never reaches the writer threads), in earlier
    versions a process-global one (it would also drop the CRC32 of a `torch.save` the trainer
    runs meanwhile). So the zip writer is opened here, per call, with the CRC32 off, and
    `torch.save`'s own serializer writes into it: no shared state at all (private functions
    of torch.serialization; torch is pinned and `tests/test_shard_writer.py` compares the
    bytes with `torch.save`'s). Called on: a writer thread of any rank, the writer process,
    or the local tier's saving thread."""
    writer = torch._C.PyTorchFileWriter(cast(IO[bytes], out), False, _get_storage_alignment())
    try:
        _save(obj, writer, pickle, DEFAULT_PROTOCOL, False)
    except BaseException:
        # Finalize even after a failed write (as torch.save's own opener does): a zip writer
        # left open finalizes in its C++ destructor when it is garbage-collected, and a write
        # that fails there throws out of a destructor, which aborts the whole process.
        with contextlib.suppress(Exception):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()


class ItemTemplates:
    """`torch.save`'s bytes for a CPU tensor (minus the zip CRC32: `save_item`) are a head,
    the bytes of its storage, and a tail, where head and tail depend only on the tensor's
    kind: dtype, shape, strides, storage offset and storage size (the pickle records these,
    the zip directory the sizes; the serialization id is fixed per process). This keeps the
    head and tail of each kind seen, learned from one real `save_item`, and writes the next
    tensors of that kind as head + bytes + tail. `tests/unit/test_shard_writer.py` compares
    the bytes with `torch.save`'s. Thread-safe (a race only learns a kind twice); at most
    `LIMIT` kinds are kept (then it starts over)."""

    LIMIT = 4096
    SMALL = 1 << 20  # smaller items are joined into a single write

    def __init__(self) -> None:
        self._kinds: dict[Kind, tuple[bytes, bytes]] = {}
        self._quick: dict[tuple[object, ...], tuple[bytes, bytes]] = {}
        """`_kinds` by the tensor's dtype, shape, strides, storage offset and storage size
        as torch gives them (no conversions), for the tensors `small_item` accepts."""

    def write(self, tensor: torch.Tensor, out: ChecksummedWriter) -> None:
        """Write `tensor` as `save_item` would, from a template when its kind allows one."""
        kind = _kind(tensor)
        if kind is None:
            save_item(tensor, out)
            return
        known = self._kinds.get(kind)
        if known is None:
            out.write(self._learn(tensor, kind))
            return
        data = storage_bytes(tensor)
        head, tail = known
        if len(data) < self.SMALL:
            out.write(b"".join((head, data, tail)))
        else:
            out.write(head)
            out.write(data)
            out.write(tail)

    def _learn(self, tensor: torch.Tensor, kind: Kind) -> bytes:
        """`tensor`'s item, serialized (`save_item`), and its kind's head and tail kept."""
        buffer = io.BytesIO()
        save_item(tensor, cast(ChecksummedWriter, buffer))
        item = buffer.getvalue()
        learned = _split_item(memoryview(item), storage_bytes(tensor))
        if learned is not None:
            if len(self._kinds) >= self.LIMIT:
                self._kinds.clear()
                self._quick.clear()
            self._kinds[kind] = learned
        return item

    def small_item(self, tensor: torch.Tensor) -> bytes | None:
        """The bytes `write` would write for `tensor`, when its storage is smaller than `SMALL`
        (the first of its kind serialized, its template learned); else None (then `write` it):
        what the shard writer gathers into one write with its neighbours, from the first save
        on (so a file's layout is the same at every save, and equal items share a place).
        Thousands of small tensors each take this path, so it looks the kind up by torch's
        own objects (`_quick_kind`) and copies the storage with one call
        (`ctypes.string_at`), not through a numpy view."""
        if (
            type(tensor) is not torch.Tensor
            or tensor.requires_grad
            or not tensor.is_cpu
            or tensor.layout is not torch.strided
        ):
            return None
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if not 0 < nbytes < self.SMALL or flips_values(tensor):
            return None
        quick = (tensor.dtype, tensor.shape, tensor.stride(), tensor.storage_offset(), nbytes)
        known = self._quick.get(quick)
        if known is None:
            kind = _kind(tensor)
            if kind is None:
                return None
            known = self._kinds.get(kind)
            if known is None:  # the first of its kind: its bytes as `write` makes them
                return self._learn(tensor, kind)
            if len(self._quick) >= self.LIMIT:
                self._quick.clear()
            self._quick[quick] = known
        return b"".join((known[0], ctypes.string_at(storage.data_ptr(), nbytes), known[1]))


_TEMPLATES = ItemTemplates()


def small_item(tensor: torch.Tensor) -> bytes | None:
    """`ItemTemplates.small_item` from the process's templates."""
    return _TEMPLATES.small_item(tensor)


def _kind(tensor: torch.Tensor) -> Kind | None:
    """What fixes a tensor's head and tail in `torch.save`'s bytes (`tensor_kind`); None for a
    tensor that always goes through the serializer (those `tensor_kind` refuses, and one that
    requires grad)."""
    return None if tensor.requires_grad else tensor_kind(tensor)


def _split_item(item: memoryview, data: memoryview) -> tuple[bytes, bytes] | None:
    """Head and tail of our own serialized `item` around its storage's bytes `data`, found
    where `torch.load` finds them (the pickle read onto the meta device: no tensor data);
    None if they are not there (then this kind is always serialized)."""
    meta = torch.load(io.BytesIO(item), map_location="meta", weights_only=True)
    start = getattr(meta.untyped_storage(), "_checkpoint_offset", None)
    n = len(data)
    if not isinstance(start, int) or item[start : start + n] != data:
        return None
    return bytes(item[:start]), bytes(item[start + n :])
