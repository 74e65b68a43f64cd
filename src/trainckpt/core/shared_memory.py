"""CPU memory that staged state is copied into: one mapping per arena, carved into tensors.

An `Arena` is either shared (an anonymous memory file, `memfd_create`, that the writer process of
`async_writer="process"` maps through a duplicate of its descriptor, `core/writer_process.py`)
or private (plain anonymous memory, for the threads' writer). Shared arenas live in the
kernel's shared memory, not in `/dev/shm` (whose size containers often cap at 64 MB), and, being
files, count against the process's file-size limit (`ulimit -f`, RLIMIT_FSIZE): `allocate`
splits shared memory into arenas no larger than that limit, so any state whose shard files the
threads could write fits. The staged tensors are carved out of arenas, each with a storage of
its own (`torch.save` writes a tensor's whole storage); shared ones are found again by address
(`locate`).

On a GPU an arena is page-locked (`cudaHostRegister`, as DCP's process mode does) with the
rank's device current, so copies from the device run asynchronously into it; that mapping is
one flat buffer, so pinning costs exactly the state's size (no power-of-two rounding of
`pin_memory=True` tensors). A refused registration leaves the arena usable, unpinned. That
path has never run on a GPU (docs/gpu.md).
"""

from __future__ import annotations

import mmap
import os
import resource
import threading
import uuid
import weakref
from dataclasses import dataclass

import torch

from trainckpt.core.cuda_calls import CudaCalls
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


@dataclass(frozen=True)
class Pinning:
    """Page-lock an arena with CUDA, with `device` current (the rank's, so that no context is
    made on another GPU)."""

    cuda: CudaCalls
    device: int


class Arena:
    """Memory holding tensors; freed when no tensor of it (and, if shared, no writer) uses it.
    Called on: any rank, on the thread that stages (or the save thread, for a scratch arena)."""

    def __init__(self, size: int, *, shared: bool, pin: Pinning | None = None) -> None:
        self.id = uuid.uuid4().hex
        self.size = max(size, ALIGN)  # a mapping cannot be empty
        self.fd = -1
        if shared:
            self.fd = _memory_file(self.id, self.size)
            try:
                self._map = mmap.mmap(self.fd, self.size)
            except OSError as e:
                os.close(self.fd)
                raise _no_memory(self.size, e) from e
        else:
            self._map = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        base = torch.frombuffer(self._map, dtype=torch.uint8, count=1)
        self.address = base.data_ptr()
        del base
        self.pin_refused = pin is not None and not _register(pin, self.address, self.size)
        self.pinned = pin is not None and not self.pin_refused
        weakref.finalize(self, _free, self.fd, self.address, pin if self.pinned else None)
        if shared:
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


def allocate(
    sizes: list[int], *, shared: bool, pin: Pinning | None = None
) -> list[tuple[Arena, int]]:
    """Buffers of `sizes` bytes: the arena and offset of each. Private memory is one arena.
    Shared memory is split into arenas within the file-size limit; a buffer larger than the
    limit goes alone into a private arena (no memory file can hold it, and no shard file the
    threads write could either: `writer_process._export` fails on it as their write would).
    Pinning stops at the first arena CUDA refuses (it is not retried)."""
    limit = file_size_limit() if shared else None
    ends: list[int] = []  # per arena: where its last buffer ends
    where: list[tuple[int, int]] = []
    for size in sizes:
        if ends and (limit is None or _aligned(ends[-1]) + size <= limit):
            offset = _aligned(ends[-1])
            ends[-1] = offset + size
        else:
            offset = 0
            ends.append(size)
        where.append((len(ends) - 1, offset))
    arenas: list[Arena] = []
    for size in ends:
        fits = limit is None or size <= limit
        arenas.append(Arena(size, shared=shared and fits, pin=pin))
        if arenas[-1].pin_refused:
            pin = None
    return [(arenas[i], offset) for i, offset in where]


def file_size_limit() -> int | None:
    """This process's file-size limit (RLIMIT_FSIZE soft limit) in bytes; None if unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def locate(t: torch.Tensor) -> tuple[Arena, Span] | None:
    """The shared arena holding `t`'s storage and where in it, or None if `t` is not in one."""
    return Locator().find(t)


class Locator:
    """`locate` for many tensors: the live arenas are listed once (a save looks up thousands of
    tensors; arenas made after this is created are not seen)."""

    def __init__(self) -> None:
        with _live_lock:
            self._arenas = [(a.address, a.address + a.size, a) for a in _live.values()]

    def find(self, t: torch.Tensor) -> tuple[Arena, Span] | None:
        """The arena holding `t`'s storage and where in it, or None if `t` is not in one."""
        storage = t.untyped_storage()
        address, size = storage.data_ptr(), storage.nbytes()
        for start, end, arena in self._arenas:
            if start <= address and address + size <= end:
                return arena, Span(arena.id, address - start, size)
        return None


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _memory_file(arena_id: str, size: int) -> int:
    """A memory file of `size` bytes (its descriptor)."""
    if not hasattr(os, "memfd_create"):
        raise ConfigurationError(
            "async_writer='process' needs Linux (memfd_create) to share the staged state "
            "with the writer process; set async_writer='thread' on this system"
        )
    try:
        fd = os.memfd_create(f"trainckpt-staging-{arena_id[:8]}", os.MFD_CLOEXEC)
    except OSError as e:
        raise _no_memory(size, e) from e
    try:
        os.ftruncate(fd, size)
    except OSError as e:
        os.close(fd)
        raise _no_memory(size, e) from e
    return fd


def _no_memory(size: int, e: OSError) -> StorageError:
    return StorageError(
        f"cannot allocate {size / 1e6:.1f} MB of shared memory to stage the checkpoint for the "
        f"writer process ({e.strerror or e}); free memory, raise the limit, or set "
        "async_writer='thread'"
    )


def _register(pin: Pinning, address: int, size: int) -> bool:
    """Page-lock the mapping at `address`; False if CUDA refuses. The refusal is cleared: left
    as this thread's last CUDA error, it would fail the next kernel launch check on it (the
    training thread's, when it stages)."""
    with pin.cuda.on_device(pin.device):
        if pin.cuda.host_register(address, size) == 0:
            return True
        pin.cuda.get_last_error()
        return False


def _free(fd: int, address: int, pin: Pinning | None) -> None:
    if pin is not None:
        with pin.cuda.on_device(pin.device):
            pin.cuda.host_unregister(address)
    if fd >= 0:
        os.close(fd)
