"""Copy a state dict into CPU memory so training can go on while the copy is written.

`Stager` keeps the buffers of the previous copy and reuses them when the next state has the same
keys, shapes and dtypes, so repeated async saves cost one copy of the state in memory, allocated
once. Only one staged copy is alive at a time: the caller must not stage again while a save of
the previous copy is still writing (the checkpointer waits for it).
"""

from __future__ import annotations

import copy
import logging
import sys
from typing import Any

import torch

log = logging.getLogger(__name__)


class Stager:
    """Stages state dicts into reusable CPU buffers."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def stage(self, state: Any) -> Any:
        """A copy of `state` whose tensors live in this stager's CPU buffers."""
        used: set[str] = set()
        staged = self._copy(state, "", used)
        for key in set(self._buffers) - used:  # drop buffers of state that went away
            del self._buffers[key]
        return staged

    def release(self) -> None:
        """Free the buffers (the next `stage` allocates anew)."""
        self._buffers.clear()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._buffers.values())

    def _copy(self, obj: Any, path: str, used: set[str]) -> Any:
        DTensor = _dtensor_type()
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
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(
                t.shape,
                dtype=t.dtype,
                device="cpu",
                pin_memory=t.is_cuda and torch.cuda.is_available(),
            )
            self._buffers[path] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf


def _dtensor_type() -> Any:
    """`DTensor` if it was imported (no DTensor can exist otherwise), else None: importing it
    takes about a second, which `import trainckpt` should not cost."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)
