"""Copy a state dict into CPU memory so training can go on while the copy is written.

`Stager` keeps the buffers of the previous copy and reuses them when the next state has the same
keys, shapes, dtypes and pinning, so repeated async saves cost one copy of the state in memory,
allocated once. For a writer process (`async_writer="process"`) the buffers are carved out of
one shared-memory arena (`shared_memory.py`) that process maps. Only one staged copy is alive
at a time: the caller must not stage again while a save of the previous copy is still writing
(the checkpointer waits for it).

On a GPU (CUDA in use by the trainer) the copies go into pinned buffers, on a side stream of the
trainer's device that first waits for the trainer's stream as it was at `mark()`: the copy reads
the state as of that point, whatever the trainer queues afterwards, and runs alongside the
trainer's next kernels. `stage` returns once the copies are complete. (State on another GPU of
the same rank is copied on that device's current stream, then that device is synchronized.)
Written to this contract but run only on CPU so far: see docs/gpu.md.
"""

from __future__ import annotations

import copy
import logging
import sys
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from trainckpt.core.shared_memory import Arena, layout

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamMark:
    """A point in the trainer's CUDA stream: the copies of a staging wait for it."""

    device: int
    event: Any  # torch.cuda.Event, recorded on the trainer's current stream


class Stager:
    """Stages state dicts into reusable CPU buffers."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._arena: Arena | None = None  # holds every buffer, in shared mode
        self._streams: dict[int, Any] = {}
        self._devices: set[int] = set()  # GPUs the current `stage` copies from

    def mark(self) -> StreamMark | None:
        """Record where the calling (training) thread's CUDA stream is; None when CUDA is not in
        use. Called on the training thread when a save is asked for."""
        if not _cuda_in_use():
            return None
        device = torch.cuda.current_device()
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return StreamMark(device, event)

    def stage(self, state: Any, after: StreamMark | None = None, *, shared: bool = False) -> Any:
        """A copy of `state` whose tensors live in this stager's CPU buffers, complete when this
        returns. `after` is the trainer's stream position the copies must follow (from
        `mark()`); staging on the training thread may leave it out (the current position).
        `shared`: the buffers are in one shared-memory arena (for a writer process).
        Called on: the training thread, or the checkpointer's background thread with `after`."""
        if shared:
            self._allocate_shared(state)
        elif self._arena is not None:
            self.release()  # the writer process is no longer used
        mark = after if after is not None else self.mark()
        stream = None if mark is None else self._side_stream(mark)
        used: set[str] = set()
        self._devices = set()
        with nullcontext() if stream is None else torch.cuda.stream(stream):
            staged = self._copy(state, "", used)
        if stream is not None and mark is not None:
            # The source tensors stay referenced by `state` until here, so the caching
            # allocator cannot hand their memory to the trainer while a copy reads it.
            stream.synchronize()
            for device in self._devices - {mark.device}:  # state on another GPU of this rank:
                torch.cuda.synchronize(device)  # copied on that device's current stream
        for key in set(self._buffers) - used:  # drop buffers of state that went away
            del self._buffers[key]
        return staged

    def release(self) -> None:
        """Free the buffers (the next `stage` allocates anew)."""
        self._buffers.clear()
        self._arena = None

    def _allocate_shared(self, state: Any) -> None:
        """Put a buffer for every tensor of `state` into one new arena, unless the current
        arena already holds buffers of exactly these keys, shapes and dtypes."""
        leaves = dict(_leaves(state, ""))
        pin = any(t.is_cuda for t in leaves.values())
        if (
            self._arena is not None
            and leaves.keys() == self._buffers.keys()
            and all(
                self._buffers[k].shape == t.shape and self._buffers[k].dtype == t.dtype
                for k, t in leaves.items()
            )
            and (self._arena.pinned or not pin)
        ):
            return
        self._buffers, self._arena = {}, None  # the old arena goes before the new one comes
        offsets, size = layout([t.numel() * t.element_size() for t in leaves.values()])
        arena = Arena(size, pin=pin)
        self._buffers = {
            k: arena.tensor(offset, t.shape, t.dtype)
            for (k, t), offset in zip(leaves.items(), offsets, strict=True)
        }
        self._arena = arena
        log.info("allocated %.1f MB of shared staging memory", size / 1e6)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def _side_stream(self, mark: StreamMark) -> Any:
        """This stager's copy stream on the mark's device, made to wait for the mark."""
        stream = self._streams.get(mark.device)
        if stream is None:
            stream = self._streams[mark.device] = torch.cuda.Stream(device=mark.device)
        stream.wait_event(mark.event)
        return stream

    def _copy(self, obj: Any, path: str, used: set[str]) -> Any:
        DTensor = dtensor_type()
        if DTensor is not None and isinstance(obj, DTensor):
            local = self._copy_tensor(obj.to_local(), path, used)
            return DTensor.from_local(
                local,
                obj.device_mesh,
                obj.placements,
                run_check=False,
                shape=obj.shape,
                stride=obj.stride(),
            )
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path, used)
        if isinstance(obj, dict):
            return {k: self._copy(v, f"{path}.{k}", used) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            items = [self._copy(v, f"{path}.{i}", used) for i, v in enumerate(obj)]
            if isinstance(obj, list):
                return items
            return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
        return copy.deepcopy(obj)

    def _copy_tensor(self, t: torch.Tensor, path: str, used: set[str]) -> torch.Tensor:
        t = t.detach()
        used.add(path)
        pin = t.is_cuda
        if pin:
            self._devices.add(t.device.index or 0)
        buf = self._buffers.get(path)
        # (is_pinned is asked only of GPU state: on a CPU trainer it could initialize CUDA. An
        # arena CUDA would not register stays in use: its copies are synchronous but right.)
        if (
            buf is None
            or buf.shape != t.shape
            or buf.dtype != t.dtype
            or (pin and self._arena is None and not buf.is_pinned())
        ):
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            self._buffers[path] = buf
        buf.copy_(t, non_blocking=pin)  # from the GPU: on the side stream, into pinned memory
        return buf


def _leaves(obj: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `Stager._copy` copies (DTensors as their local shards), keyed as it keys
    its buffers."""
    DTensor = dtensor_type()
    if DTensor is not None and isinstance(obj, DTensor):
        yield path, obj.to_local().detach()
    elif isinstance(obj, torch.Tensor):
        yield path, obj.detach()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{path}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{path}.{i}")


def _cuda_in_use() -> bool:
    """CUDA is there and the trainer has used it (staging never initializes CUDA itself)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def dtensor_type() -> Any:
    """`DTensor` if it was imported (no DTensor can exist otherwise), else None: importing it
    takes about a second, which `import trainckpt` should not cost."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)
