"""Copy a state dict into CPU memory so training can go on while the copy is written.

`Stager` copies every tensor of the state (a DTensor: its local shard) into one flat buffer
(an arena, `shared_memory.py`; for a writer process, shared ones that process maps), and keeps
it for the next state of the same keys, shapes and dtypes: repeated async saves cost one copy of
the state in memory, allocated once. Only one staged copy is alive at a time: the caller must
not stage again while a save of the previous copy is still writing (the checkpointer waits for
it). A staged DTensor keeps its mesh and placements but its local tensor is the CPU buffer
(built as DCP's own stager builds it: `DTensor.from_local` would move it back to the mesh's
device), so the writers never see device memory. `Partial` placements are refused.

On a GPU, with the rank's device current throughout (no context on another GPU): the buffer is
page-locked; `mark` records an event on the trainer's current stream of every device holding
state; the copies run non-blocking on a side stream per device that first waits for that event,
so they read the state as of `mark` and overlap the trainer's next kernels; every side stream is
synchronized before `stage` returns. All CUDA calls go through `CudaCalls` (`cuda_calls.py`).
Written to this contract but run only on CPU, with a recording fake (docs/gpu.md).
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from trainckpt.core.cuda_calls import CudaCalls
from trainckpt.core.shared_memory import Arena, Pinning, allocate
from trainckpt.errors import ConfigurationError
from trainckpt.format.content_hash import (
    LARGE_ITEM,
    StorageDigests,
    StorageKey,
    storage_key,
    tensor_digest,
    tensor_kind,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamMark:
    """Where the trainer's CUDA streams were when a save was asked for."""

    device: int
    """The rank's device: current on the training thread at `mark`."""
    events: dict[int, Any]
    """Per device holding state: an event recorded on the trainer's current stream there."""


class Stager:
    """Stages state dicts into one reusable CPU buffer. `cuda`: the CUDA calls (tests pass a
    fake). `on_release` runs whenever the buffers are dropped (the writer process unmaps its
    views of them then)."""

    def __init__(
        self, cuda: CudaCalls | None = None, on_release: Callable[[], None] | None = None
    ) -> None:
        self.cuda = cuda if cuda is not None else CudaCalls()
        self._on_release = on_release
        self._by_position: list[torch.Tensor] = []
        """The buffers, in the order `_gather` finds the tensors."""
        self._arenas: list[Arena] = []  # hold every buffer
        self._layout: tuple[bool, bool, list[tuple[torch.Size, torch.dtype]]] | None = None
        self._streams: dict[int, Any] = {}
        self._pin_refused = False  # CUDA refused to page-lock: never asked again
        self.digests: StorageDigests | None = None
        """Set for incremental saves: a large CPU tensor whose buffer still holds its bytes
        (as hashed by the last save) is not copied again (`_skip_unchanged`)."""
        self._changed: set[int] = set()  # positions found changed once: copied without hashing

    def mark(self, state: Any) -> StreamMark | None:
        """Record where the calling (training) thread's CUDA streams are on every device that
        holds a tensor of `state`; None when none does. Called on the training thread when a
        save is asked for."""
        if not self.cuda.in_use():
            return None
        devices = sorted(_devices(state, self.cuda))
        if not devices:
            return None
        return StreamMark(self.cuda.current_device(), {d: self.cuda.mark(d) for d in devices})

    def wait_for_trainer(self, state: Any) -> None:
        """Wait for the work the calling thread queued on its current streams of the devices
        holding `state`: a synchronous save's writer threads then read it on their own streams.
        Called on: the training thread."""
        if self.cuda.in_use():
            for device in sorted(_devices(state, self.cuda)):
                self.cuda.synchronize_current(device)

    def stage(self, state: Any, after: StreamMark | None = None, *, shared: bool = False) -> Any:
        """A copy of `state` whose tensors live in this stager's CPU buffers, complete when this
        returns. `after` is the trainer's stream position the copies must follow (`mark(state)`);
        staging on the training thread may leave it out (the current position).
        `shared`: the buffers are in shared memory (for a writer process).
        Called on: the training thread, or the checkpointer's background thread with `after`.

        The state is walked twice (collect, rebuild), by position, without a key path per
        entry: with thousands of entries a background save's walk holds the interpreter lock
        that the training thread waits for (docs/scale.md)."""
        DTensor = dtensor_type()
        tensors: list[torch.Tensor] = []
        try:
            _gather(state, DTensor, tensors)
        except _PartialFound:
            _leaves(state, "", refuse_partial=True)  # raises, naming the entry
            raise
        mark = after if after is not None else self.mark(state)
        with nullcontext() if mark is None else self.cuda.on_device(mark.device):
            fresh = self._allocate(tensors, shared, mark)
            self._copy(tensors, mark, fresh)
        return _placed(state, iter(self._by_position), DTensor)

    def release(self) -> None:
        """Free the buffers (the next `stage` allocates anew)."""
        self._by_position, self._arenas, self._layout = [], [], None
        self._changed = set()
        if self.digests is not None:
            self.digests.clear()
        if self._on_release is not None:
            self._on_release()

    @property
    def nbytes(self) -> int:
        """Bytes of memory the buffers take (the arenas: the state's bytes, each buffer's start
        aligned to 64 bytes)."""
        return sum(arena.size for arena in self._arenas)

    def _allocate(self, tensors: list[torch.Tensor], shared: bool, mark: Any) -> bool:
        """A buffer for every tensor of `tensors` (the state's, in `_gather`'s order), in new
        arenas unless the current ones hold buffers of exactly these shapes and dtypes in this
        order (and were pinned if asked to). Buffers go by position: the keys do not matter,
        as `_placed` puts each buffer where its tensor was. True when the buffers are new."""
        pin = mark is not None and not self._pin_refused
        layout = [(t.shape, t.dtype) for t in tensors]
        if self._layout is not None:
            was_shared, was_pinned, old = self._layout
            if old == layout and was_shared == shared and (was_pinned or not pin):
                return False
        self.release()  # the old buffers go before the new ones come
        places = allocate(
            [t.numel() * t.element_size() for t in tensors],
            shared=shared,
            pin=Pinning(self.cuda, mark.device) if pin else None,
        )
        self._by_position = [
            arena.tensor(offset, t.shape, t.dtype)
            for t, (arena, offset) in zip(tensors, places, strict=True)
        ]
        self._arenas = list(dict.fromkeys(arena for arena, _ in places))  # by identity
        self._layout = (shared, pin, layout)
        if any(arena.pin_refused for arena in self._arenas):
            self._pin_refused = True
            log.warning(
                "CUDA refused to page-lock %.1f MB of staging memory (cudaHostRegister); staging "
                "goes on in unpinned memory, where each copy from the GPU is slower and waits for "
                "the copy stream (docs/gpu.md). Not retried in this process.",
                self.nbytes / 1e6,
            )
        log.info("allocated %.1f MB of staging memory", self.nbytes / 1e6)
        return True

    def _copy(self, tensors: list[torch.Tensor], mark: StreamMark | None, fresh: bool) -> None:
        """Fill the buffers: CPU tensors at once (but those whose buffer holds their bytes
        already, `_skip_unchanged`, unless the buffers are `fresh`); device tensors on each
        device's side stream after the mark, then wait for every side stream. The sources
        stay referenced (by `tensors`) until then, so the caching allocator cannot hand their
        memory to the trainer while a copy reads it. No autograd: the copies are made without
        recording them."""
        on_device: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        on_cpu: tuple[list[torch.Tensor], list[torch.Tensor]] = (self._by_position, tensors)
        cpu_at: list[int] | range = range(len(tensors))
        if mark is not None:
            on_cpu, cpu_at = ([], []), []
            for i, (buf, t) in enumerate(zip(self._by_position, tensors, strict=True)):
                device = self.cuda.device_of(t)
                if device is None:
                    cpu_at.append(i)
                    on_cpu[0].append(buf)
                    on_cpu[1].append(t)
                else:
                    on_device.setdefault(device, []).append((buf, t.detach()))
        if self.digests is not None:
            hashed = {} if fresh else self.digests.hashed
            self.digests.hashed, self.digests.vouched = {}, {}  # before any buffer is written
            if hashed:
                on_cpu, vouched = self._skip_unchanged(cpu_at, on_cpu, hashed)
                # what holds now: the buffers not written (every other one is, below)
                self.digests.hashed, self.digests.vouched = dict(vouched), vouched
        if on_cpu[0]:
            with torch.no_grad():  # one call: thousands of small copies cost no more
                torch._foreach_copy_(*on_cpu)
        streams = []
        for device, pairs in on_device.items():
            assert mark is not None
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = self.cuda.new_stream(device)
            self.cuda.wait(stream, mark.events[device])
            with self.cuda.on_stream(stream):
                for buf, t in pairs:
                    self.cuda.copy(buf, t)
            streams.append(stream)
        for stream in streams:
            self.cuda.synchronize(stream)

    def _skip_unchanged(
        self,
        positions: list[int] | range,
        pairs: tuple[list[torch.Tensor], list[torch.Tensor]],
        hashed: dict[StorageKey, bytes],
    ) -> tuple[tuple[list[torch.Tensor], list[torch.Tensor]], dict[StorageKey, bytes]]:
        """Of the CPU (buffer, source) `pairs` (at `positions` of the state), drop those whose
        buffer holds the source's bytes already: the last save hashed the buffer (`hashed`, by
        storage), and the source, hashed now (xxh3-128 of every byte: no version counter is
        trusted, docs/incremental.md), has that hash. Their hashes are returned (to become
        `digests.vouched`), for the save to take instead of hashing the buffer again. A frozen
        base then costs a hash (on two threads: xxh3 releases the interpreter lock) instead of
        a copy and a hash. A source found changed once is copied without hashing from then on
        (a trained state pays no hash here). Returns the pairs left to copy, and the hashes of
        the buffers kept."""
        todo: list[tuple[int, torch.Tensor, torch.Tensor, bytes]] = []
        rest: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for i, buf, src in zip(positions, *pairs, strict=True):
            large = buf.nbytes >= LARGE_ITEM and i not in self._changed
            known = hashed.get(storage_key(buf)) if large else None
            if known is not None and _holds_alike(buf, src):
                todo.append((i, buf, src, known))
            else:
                rest[0].append(buf)
                rest[1].append(src)
        if not todo:
            return rest, {}
        with ThreadPoolExecutor(min(2, len(todo)), thread_name_prefix="trainckpt-stage") as pool:
            digests = list(pool.map(lambda job: tensor_digest(job[2]), todo))
        vouched: dict[StorageKey, bytes] = {}
        for (i, buf, src, known), digest in zip(todo, digests, strict=True):
            if digest == known:
                vouched[storage_key(buf)] = digest
            else:
                self._changed.add(i)
                rest[0].append(buf)
                rest[1].append(src)
        log.debug("staging: %d of %d large tensors unchanged, not copied", len(vouched), len(todo))
        return rest, vouched


def _holds_alike(buf: torch.Tensor, src: torch.Tensor) -> bool:
    """True when `src` is a large plain CPU tensor whose storage holds exactly its bytes in
    order, as its buffer `buf`'s does: equal storage hashes then mean equal tensors."""
    if type(src) is torch.nn.Parameter:
        src = src.detach()  # a frozen parameter kept as one (keep_vars): its plain view
    if tensor_kind(src) is None or src.dtype != buf.dtype or src.shape != buf.shape:
        return False
    n = src.numel() * src.element_size()
    return (
        src.is_contiguous()
        and src.storage_offset() == 0
        and src.untyped_storage().nbytes() == n
        and buf.untyped_storage().nbytes() == n
        and buf.is_contiguous()
        and buf.storage_offset() == 0
    )


_IMMUTABLE = frozenset({type(None), bool, int, float, complex, str, bytes})
"""Leaf types a staged copy may share with the state (what `copy.deepcopy` returns as is)."""


class _PartialFound(Exception):
    """`_gather` met a DTensor with a `Partial` placement (`stage` names it)."""


def _gather(obj: Any, DTensor: Any, out: list[torch.Tensor]) -> None:
    """Append the tensors of `obj` to `out` (DTensors as their local shards) in the order
    `_collect` finds them, without key paths or detached copies. A DTensor with a `Partial`
    placement raises `_PartialFound`."""
    kind = type(obj)
    if kind is dict:
        for v in obj.values():
            k = type(v)
            if k is torch.Tensor:
                out.append(v)
            elif k not in _IMMUTABLE:
                _gather(v, DTensor, out)
    elif kind is torch.Tensor:
        out.append(obj)
    elif kind in _IMMUTABLE:
        return
    elif DTensor is not None and isinstance(obj, DTensor):
        if any(p.is_partial() for p in obj.placements):
            raise _PartialFound
        out.append(obj.to_local())
    elif isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for v in obj.values():
            _gather(v, DTensor, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _gather(v, DTensor, out)


def _placed(obj: Any, buffers: Iterator[torch.Tensor], DTensor: Any) -> Any:
    """`obj` with each tensor replaced by the next of `buffers` (in `_gather`'s order)."""
    kind = type(obj)
    if kind is dict:
        out = {}
        for key, v in obj.items():
            k = type(v)
            if k is torch.Tensor:
                out[key] = next(buffers)
            elif k in _IMMUTABLE:
                out[key] = v
            else:
                out[key] = _placed(v, buffers, DTensor)
        return out
    if kind in _IMMUTABLE:
        return obj
    if kind is torch.Tensor:
        return next(buffers)
    if DTensor is not None and isinstance(obj, DTensor):
        # As DCP's stager does: the local tensor stays the CPU buffer, mesh and placements
        # stay as they are (from_local would copy it to the mesh's device).
        return DTensor(next(buffers), obj._spec, requires_grad=False)
    if isinstance(obj, torch.Tensor):
        return next(buffers)
    if isinstance(obj, dict):
        return {k: _placed(v, buffers, DTensor) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_placed(v, buffers, DTensor) for v in obj]
        if isinstance(obj, list):
            return items
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return copy.deepcopy(obj)


def _leaves(obj: Any, path: str, refuse_partial: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of `obj` to copy (DTensors as their local shards), keyed by path. With
    `refuse_partial`, a DTensor with a `Partial` placement is refused: its local tensors are
    not shards of the value but summands of it, which no checkpoint stores."""
    found: dict[str, torch.Tensor] = {}
    _collect(obj, path, refuse_partial, dtensor_type(), found)
    return found


def _collect(
    obj: Any, path: str, refuse_partial: bool, DTensor: Any, found: dict[str, torch.Tensor]
) -> None:
    kind = type(obj)
    if kind in _IMMUTABLE:
        return
    if kind is torch.Tensor:
        found[path] = obj.detach()
    elif DTensor is not None and isinstance(obj, DTensor):
        if refuse_partial and any(p.is_partial() for p in obj.placements):
            raise ConfigurationError(
                f"cannot stage '{path.lstrip('.')}': it is a DTensor with a Partial placement "
                f"({obj.placements}), a pending reduction; reduce it first (e.g. "
                "redistribute to Replicate) before saving"
            )
        found[path] = obj.to_local().detach()
    elif isinstance(obj, torch.Tensor):
        found[path] = obj.detach()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _collect(v, f"{path}.{k}", refuse_partial, DTensor, found)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _collect(v, f"{path}.{i}", refuse_partial, DTensor, found)


def _devices(state: Any, cuda: CudaCalls) -> set[int]:
    """The CUDA devices holding a tensor of `state`."""
    found = (cuda.device_of(t) for t in _leaves(state, "").values())
    return {d for d in found if d is not None}


def dtensor_type() -> Any:
    """`DTensor` if it was imported (no DTensor can exist otherwise), else None: importing it
    takes about a second, which `import trainckpt` should not cost."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)
