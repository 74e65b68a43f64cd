"""Every CUDA call that staging makes, in one object.

`Stager` (`staging.py`) and its arenas (`shared_memory.py`) call CUDA only through a
`CudaCalls`, so a test can hand them a recording fake and check, without a GPU, the order and
the device of every call (`tests/unit/test_gpu_staging.py`). This class is the real thing; it is
kept to one line per call, since no GPU has run it yet (docs/gpu.md lists what has).
"""

from __future__ import annotations

import ctypes
import logging
from contextlib import AbstractContextManager
from typing import Any

import torch

log = logging.getLogger(__name__)


class CudaCalls:
    """The CUDA runtime as staging uses it. Called on: the thread that stages (training thread
    or the checkpointer's save thread), and `unregister` wherever an arena is freed."""

    def in_use(self) -> bool:
        """CUDA is there and the trainer has used it (staging never initializes CUDA itself)."""
        return torch.cuda.is_available() and torch.cuda.is_initialized()

    def available(self) -> bool:
        """This process can use CUDA (loading puts trainer-state tensors back on the GPU)."""
        return torch.cuda.is_available()

    def to_device(self, t: torch.Tensor, device: int) -> torch.Tensor:
        """A copy of host tensor `t` on `device`, complete when the trainer reads it."""
        return t.to(torch.device("cuda", device))

    def device_of(self, t: torch.Tensor) -> int | None:
        """The CUDA device `t` lives on; None when it is not on a CUDA device."""
        if not t.is_cuda:
            return None
        return t.device.index if t.device.index is not None else torch.cuda.current_device()

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def on_device(self, device: int) -> AbstractContextManager[Any]:
        """Make `device` current on this thread (a new context is made there, if any)."""
        return torch.cuda.device(device)

    def mark(self, device: int) -> Any:
        """An event recorded on this thread's current stream of `device`."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def new_stream(self, device: int) -> Any:
        return torch.cuda.Stream(device=device)

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on `stream` from now on runs after `event`."""
        stream.wait_event(event)

    def on_stream(self, stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue the copy of device tensor `src` into host tensor `dst` on the current stream;
        asynchronous when `dst` is page-locked."""
        dst.copy_(src, non_blocking=True)

    def synchronize(self, stream: Any) -> None:
        stream.synchronize()

    def synchronize_current(self, device: int) -> None:
        """Wait for what this thread queued so far on its current stream of `device`."""
        torch.cuda.current_stream(device).synchronize()

    def host_register(self, address: int, size: int) -> int:
        """Page-lock `size` bytes at `address`: cudaHostRegister's error code (0: done)."""
        return int(torch.cuda.cudart().cudaHostRegister(address, size, 0))

    def host_unregister(self, address: int) -> int:
        return int(torch.cuda.cudart().cudaHostUnregister(address))

    def get_last_error(self) -> int:
        """cudaGetLastError: this thread's last CUDA error, which it resets. Torch binds no such
        call; libcudart is in the process's global namespace (torch loads it with
        libtorch_global_deps)."""
        try:
            return int(ctypes.CDLL(None).cudaGetLastError())
        except (AttributeError, OSError):
            log.warning(
                "cannot reset this thread's last CUDA error (cudaGetLastError not found); the "
                "next CUDA call checked on this thread may report an earlier one"
            )
            return -1
