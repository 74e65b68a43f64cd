"""The content hash of a staged tensor: what an incremental save (`core/incremental.py`)
compares with the previous save's to call an item unchanged.

xxh3-128 over the bytes `torch.save` writes for the tensor (its whole storage: the shard
writer clones views first), plus the tensor's kind (dtype, shape, strides, storage offset and
size), which fix the rest of those bytes. 128 bits, so an accidental collision is out of reach
(CRC32C, 32 bits, is not enough to call two items equal); xxh3 runs at memory speed and releases
the interpreter lock on large buffers, so hashing costs a fraction of writing the same bytes.
"""

from __future__ import annotations

import io

import torch
import xxhash

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
        or tensor.is_conj()
        or tensor.is_neg()
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
    return xxhash.xxh3_128_digest(storage_bytes(tensor))


def storage_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of `tensor`'s whole storage, without a copy (what `torch.save` writes)."""
    storage = tensor.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
    return memoryview(flat.numpy())  # type: ignore[arg-type]


def bytes_digest(data: io.BytesIO | bytes) -> bytes:
    """xxh3-128 of a byte item (a non-tensor value, as DCP serialized it)."""
    return xxhash.xxh3_128_digest(data.getbuffer() if isinstance(data, io.BytesIO) else data)
