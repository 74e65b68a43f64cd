"""A recording stand-in for the CUDA calls of staging (`trainckpt.core.cuda_calls.CudaCalls`).

CPU tensors are claimed to live on a GPU (`claim`). Like CUDA it keeps a current device and a
current stream per thread, and a last error per thread; a non-blocking copy is only queued on
the current stream and happens when that stream is synchronized, so a stager that reads its
buffers before synchronizing reads nothing. Every call is recorded with the thread's current
device, for tests to check the order and the device of each.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from trainckpt.core.cuda_calls import CudaCalls

REFUSED = 712  # cudaErrorHostMemoryAlreadyRegistered, say


@dataclass(eq=False)
class FakeStream:
    device: int
    name: str
    queued: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass(eq=False)
class FakeEvent:
    stream: FakeStream


@dataclass(frozen=True)
class Call:
    name: str
    device: int
    """The calling thread's current device."""
    thread: int
    args: tuple[Any, ...]


class RecordingCuda(CudaCalls):
    def __init__(self, *, current_device: int = 0, refuse_pinning: bool = False) -> None:
        self.calls: list[Call] = []
        self.refuse_pinning = refuse_pinning
        self._default_device = current_device  # of the thread that made this fake
        self._owner = threading.get_ident()
        self._on: dict[int, int] = {}  # storage address -> device
        self._local = threading.local()
        self._trainer_streams: dict[int, FakeStream] = {}
        self._lock = threading.Lock()
        self.last_error: dict[int, int] = {}  # per thread
        self.pinned: dict[int, int] = {}  # address -> size

    def claim(self, t: torch.Tensor, device: int) -> None:
        """Pretend `t` lives on GPU `device`."""
        self._on[t.untyped_storage().data_ptr()] = device

    def named(self, name: str) -> list[Call]:
        return [c for c in self.calls if c.name == name]

    # -- thread state, as CUDA keeps it --------------------------------------------------------
    def _device(self) -> int:
        default = self._default_device if threading.get_ident() == self._owner else 0
        return getattr(self._local, "device", default)

    def _stream(self) -> FakeStream:
        stream = getattr(self._local, "stream", None)
        if stream is None or stream.device != self._device():
            return self.trainer_stream(self._device())
        return stream

    def trainer_stream(self, device: int) -> FakeStream:
        """The default stream of `device` (the trainer's current one)."""
        with self._lock:
            return self._trainer_streams.setdefault(device, FakeStream(device, "default"))

    def _record(self, name: str, *args: Any) -> None:
        with self._lock:
            self.calls.append(Call(name, self._device(), threading.get_ident(), args))

    # -- the calls ------------------------------------------------------------------------------
    def in_use(self) -> bool:
        return True

    def available(self) -> bool:
        return True

    def to_device(self, t: torch.Tensor, device: int) -> torch.Tensor:
        """A copy of `t` claimed to live on `device`."""
        self._record("to_device", device)
        moved = t.clone()
        self.claim(moved, device)
        return moved

    def device_of(self, t: torch.Tensor) -> int | None:
        return self._on.get(t.untyped_storage().data_ptr())

    def current_device(self) -> int:
        return self._device()

    @contextmanager
    def on_device(self, device: int) -> Iterator[None]:
        self._record("on_device", device)
        before = getattr(self._local, "device", None)
        self._local.device = device
        try:
            yield
        finally:
            if before is None:
                del self._local.device
            else:
                self._local.device = before

    def mark(self, device: int) -> FakeEvent:
        event = FakeEvent(self.trainer_stream(device))
        self._record("mark", device, event)
        return event

    def new_stream(self, device: int) -> FakeStream:
        stream = FakeStream(device, "side")
        self._record("new_stream", device, stream)
        return stream

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        self._record("wait", stream, event)

    @contextmanager
    def on_stream(self, stream: FakeStream) -> Iterator[None]:
        """Current stream, and its device current (as `torch.cuda.stream` does)."""
        self._record("on_stream", stream)
        before = getattr(self._local, "stream", None)
        self._local.stream = stream
        try:
            with self.on_device(stream.device):
                yield
        finally:
            self._local.stream = before

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        stream = self._stream()
        pinned = any(a <= dst.data_ptr() < a + size for a, size in self.pinned.items())
        self._record("copy", stream, self.device_of(src), pinned)
        stream.queued.append((dst, src))  # non-blocking: done when the stream is synchronized

    def synchronize(self, stream: FakeStream) -> None:
        self._record("synchronize", stream)
        for dst, src in stream.queued:
            dst.copy_(src)
        stream.queued.clear()

    def synchronize_current(self, device: int) -> None:
        self._record("synchronize_current", device)

    def host_register(self, address: int, size: int) -> int:
        self._record("host_register", address, size)
        if self.refuse_pinning:
            self.last_error[threading.get_ident()] = REFUSED
            return REFUSED
        self.pinned[address] = size
        return 0

    def host_unregister(self, address: int) -> int:
        self._record("host_unregister", address)
        self.pinned.pop(address, None)
        return 0

    def get_last_error(self) -> int:
        self._record("get_last_error")
        return self.last_error.pop(threading.get_ident(), 0)
