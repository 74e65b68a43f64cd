"""CPU memory that a writer process can read without a copy: the staged state of async saves
with `async_writer="process"`.

An `Arena` is one anonymous memory file (`memfd_create`), mapped here and, by the writer
process, through a duplicate of its descriptor (`core/writer_process.py`). It lives in the
kernel's shared memory, not in `/dev/shm` (whose size containers often cap at 64 MB). The
staged tensors are carved out of it, each with a storage of its own (`torch.save` writes a
tensor's whole storage), and found again by address (`locate`).

On a GPU the arena is registered with CUDA (`cudaHostRegister`, as DCP's process mode does) so
copies from the device run asynchronously into it; that path has never run here (no GPU).
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid
import weakref
from dataclasses import dataclass

import torch

from trainckpt.errors import ConfigurationError, StorageError

ALIGN = 64
"""Byte alignment of every tensor in an arena (any dtype's, and a cache line)."""

_live: weakref.WeakValueDictionary[str, Arena] = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


@dataclass(frozen=True)
class Span:
    """Where a tensor's storage lies: `size` bytes at `offset` in arena `arena_id`."""

    arena_id: str
    offset: int
    size: int


class Arena:
    """Shared memory holding tensors; freed when no tensor of it and no writer uses it."""

    def __init__(self, size: int, *, pin: bool = False) -> None:
        """Called on: any rank, on the thread that stages."""
        self.id = uuid.uuid4().hex
        self.size = max(size, ALIGN)  # a mapping cannot be empty
        if not hasattr(os, "memfd_create"):
            raise ConfigurationError(
                "async_writer='process' needs Linux (memfd_create) to share the staged state "
                "with the writer process; set async_writer='thread' on this system"
            )
        try:
            self.fd = os.memfd_create(f"trainckpt-staging-{self.id[:8]}", os.MFD_CLOEXEC)
        except OSError as e:
            raise _no_memory(self.size, e) from e
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size)
        except OSError as e:
            os.close(self.fd)
            raise _no_memory(self.size, e) from e
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1)
        self.address = base.data_ptr()
        del base
        self.pinned = pin and _register_with_cuda(self.address, self.size)
        weakref.finalize(self, _free, self.fd, self.address if self.pinned else None)
        with _live_lock:
            _live[self.id] = self

    def tensor(self, offset: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of `shape` and `dtype` at `offset`, with a storage of exactly its bytes (it
        keeps the mapping alive; whoever uses it keeps the arena, and so its pinning)."""
        count = shape.numel()
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=offset)
        return flat.view(shape)

    def copy_of(self, offset: int, t: torch.Tensor) -> torch.Tensor:
        """A copy of CPU tensor `t` at `offset`, laid out as `t` is (same storage size,
        strides and storage offset), so `torch.save` writes the same bytes for both."""
        storage = self.tensor(offset, torch.Size([t.untyped_storage().nbytes()]), torch.uint8)
        copy = storage.view(t.dtype).as_strided(t.shape, t.stride(), t.storage_offset())
        return copy.copy_(t)


def layout(sizes: list[int]) -> tuple[list[int], int]:
    """Aligned offsets for buffers of `sizes` bytes, and the arena size they need."""
    offsets, end = [], 0
    for size in sizes:
        offsets.append(end)
        end += -(-size // ALIGN) * ALIGN
    return offsets, end


def locate(t: torch.Tensor) -> tuple[Arena, Span] | None:
    """The arena holding `t`'s storage and where in it, or None if `t` is not in one."""
    storage = t.untyped_storage()
    address, size = storage.data_ptr(), storage.nbytes()
    with _live_lock:
        arenas = list(_live.values())
    for arena in arenas:
        if arena.address <= address and address + size <= arena.address + arena.size:
            return arena, Span(arena.id, address - arena.address, size)
    return None


def _no_memory(size: int, e: OSError) -> StorageError:
    return StorageError(
        f"cannot allocate {size / 1e6:.1f} MB of shared memory to stage the checkpoint for the "
        f"writer process ({e.strerror or e}); free memory, raise the limit, or set "
        "async_writer='thread'"
    )


def _register_with_cuda(address: int, size: int) -> bool:
    """Page-lock the arena for asynchronous device-to-host copies; False if CUDA refuses."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return False
    return int(torch.cuda.cudart().cudaHostRegister(address, size, 0)) == 0


def _free(fd: int, pinned_address: int | None) -> None:
    if pinned_address is not None:
        torch.cuda.cudart().cudaHostUnregister(pinned_address)
    os.close(fd)
