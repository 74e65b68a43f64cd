"""The content hash of a staged tensor: what an incremental save (`core/incremental.py`)
compares with the previous save's to call an item unchanged.

xxh3-128 over the bytes `torch.save` writes for the tensor (its whole storage: the shard
writer clones views first), plus the tensor's kind (dtype, shape, strides, storage offset and
size), which fix the rest of those bytes. 128 bits, so an accidental collision is out of reach
(CRC32C, 32 bits, is not enough to call two items equal); xxh3 runs at memory speed and releases
the interpreter lock on large buffers, so hashing costs a fraction of writing the same bytes.
"""

from __future__ import annotations

import ctypes
import io

import torch
import xxhash

from trainckpt.format.tensor_flags import flips_values

Kind = tuple[str, tuple[int, ...], tuple[int, ...], int, int]


def tensor_kind(tensor: torch.Tensor) -> Kind | None:
    """What fixes the rest of a tensor's serialized bytes besides its storage: dtype, shape,
    strides, storage offset and storage size; None for a tensor that is never hashed (a
    subclass, not a plain strided CPU tensor, quantized, lazily conjugated or negated, empty)."""
    if (
        type(tensor) is not torch.Tensor
        or not tensor.is_cpu
        or tensor.layout != torch.strided
        or tensor.is_quantized
        or flips_values(tensor)
    ):
        return None
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes == 0:
        return None
    return (
        str(tensor.dtype),
        tuple(tensor.shape),
        tuple(tensor.stride()),
        int(tensor.storage_offset()),
        nbytes,
    )


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """xxh3-128 of the bytes of `tensor`'s whole storage (no copy). Call only for a tensor
    `tensor_kind` accepts. Called on: any thread (the interpreter lock is released while
    hashing a large buffer)."""
    storage = tensor.untyped_storage()  # held until hashed: `view` does not keep it alive
    view = (ctypes.c_char * storage.nbytes()).from_address(storage.data_ptr())
    return xxhash.xxh3_128_digest(view)  # the bytes of `storage_bytes`, at a third of its cost


def item_digest(item: bytes) -> bytes:
    """xxh3-128 of a small tensor's item bytes as the shard writer writes them
    (`tensor_item.small_item`: a head and tail fixed by the tensor's kind around its storage's
    bytes), so equal digests mean equal bytes in the file. Called on: the saving thread, and
    the writer threads (or process), which hash the items they make anyway."""
    return xxhash.xxh3_128_digest(item)


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor`'s whole storage, without a copy (what `torch.save` writes)."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return memoryview(flat.numpy())  # type: ignore[arg-type]


def bytes_digest(data: io.BytesIO | bytes) -> bytes:
    """xxh3-128 of a byte item (a non-tensor value, as DCP serialized it)."""
    return xxhash.xxh3_128_digest(data.getbuffer() if isinstance(data, io.BytesIO) else data)


LARGE_ITEM = 1 << 20
"""Bytes from which a tensor counts as large: an incremental save hashes it on a thread of its
own (a smaller one is hashed in less time than handing it to a thread takes, and a fine-tune's
adapters and optimizer values are thousands of such items), starting with the save
(`incremental.Prehash`), and only such storages are in `StorageDigests.hashed`, so only such a
staging copy may be skipped (`core/staging.py`)."""


StorageKey = tuple[int, int]
"""A storage's (address, size in bytes): while it is alive, no other storage has both."""


def storage_key(tensor: torch.Tensor) -> StorageKey:
    """The `StorageKey` of `tensor`'s storage."""
    storage = tensor.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class StorageDigests:
    """What an incremental save and the stager of async saves tell each other about the
    hashes of storages (one per `Checkpointer`, docs/incremental.md):

    - `hashed`: every large storage the last save hashed (`incremental.Prehash`), by
      `StorageKey`: the bytes it held then. The stager compares it with a source's hash to
      tell whether its buffer still holds that source's bytes, and skips that copy.
    - `vouched`: the stager's buffers whose copy the last staging skipped: their bytes are
      those hashed before (nothing but the stager writes into its buffers), so the save takes
      those hashes instead of hashing them again.

    Each is replaced as a whole (one assignment), by one save or staging at a time."""

    def __init__(self) -> None:
        self.hashed: dict[StorageKey, bytes] = {}
        self.vouched: dict[StorageKey, bytes] = {}

    def clear(self) -> None:
        """The stager's buffers are dropped: no hash of them holds any more."""
        self.hashed, self.vouched = {}, {}
