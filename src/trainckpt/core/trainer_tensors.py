"""GPU tensors of a trainer state: staged with the module's tensors, written from the CPU copy,
put back on the rank's device when loaded.

A trainer state with no tensor on a GPU is serialized at once, on the training thread, as it
always was (`format/trainer_state.py`, format 1). One with GPU tensors is split there: its
structure and other values are copied now (the trainer may change them as soon as the save call
returns), its GPU tensors go to the `Stager` beside the module's (ordered by the same mark, no
synchronous copy on the training thread), and the file is serialized from their staged CPU
copies, recording the device of each (format 2). All CUDA calls go through `CudaCalls`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from trainckpt.core.cuda_calls import CudaCalls
from trainckpt.format.trainer_state import (
    TensorPath,
    ToDevice,
    check_trainer_state,
    map_tensors,
    serialize_trainer_state,
)

log = logging.getLogger(__name__)

STAGED_KEY = "trainckpt: trainer-state tensors"
"""Where `with_tensors` puts the trainer state's GPU tensors beside the module's state."""


@dataclass(frozen=True)
class _Slot:
    """Where a GPU tensor goes back into the skeleton: its index in `tensors`."""

    index: int


@dataclass(frozen=True)
class DeferredTrainerState:
    """A trainer state whose GPU tensors are still to be copied: its structure and other
    values as of the save call, and its GPU tensors with their paths and devices."""

    skeleton: dict[str, Any]
    tensors: list[torch.Tensor]
    devices: list[tuple[TensorPath, int]]
    where: str
    max_bytes: int

    def serialize(self, copies: Sequence[torch.Tensor]) -> bytes:
        """The file's bytes, with `copies` (the tensors' CPU copies, in order) in their places.
        Called on: every rank, on the thread that staged."""
        state = map_tensors(self.skeleton, lambda _, slot: copies[slot.index], _Slot)
        return serialize_trainer_state(state, self.where, self.max_bytes, self.devices)

    def with_tensors(self, module_state: dict[str, Any]) -> dict[str, Any]:
        """`module_state` with the GPU tensors beside it, to stage them all at once."""
        return {**module_state, STAGED_KEY: self.tensors}

    @staticmethod
    def split(staged: dict[str, Any]) -> tuple[dict[str, Any], list[torch.Tensor]]:
        """The staged module state and the staged GPU tensors of a `with_tensors` state."""
        rest = dict(staged)
        return rest, rest.pop(STAGED_KEY)


def prepare(
    train_state: dict[str, Any], where: str, max_bytes: int, cuda: CudaCalls
) -> bytes | DeferredTrainerState:
    """The trainer-state file's bytes when no tensor of `train_state` is on a GPU; otherwise a
    `DeferredTrainerState` to stage and serialize. A state that would not load back is refused
    now either way. Called on: every rank, on the training thread."""
    check_trainer_state(train_state, where)
    tensors: list[torch.Tensor] = []
    devices: list[tuple[TensorPath, int]] = []

    def take(path: TensorPath, t: torch.Tensor) -> Any:
        device = cuda.device_of(t) if cuda.in_use() else None
        if device is None:
            return t
        devices.append((path, device))
        tensors.append(t.detach())
        return _Slot(len(tensors) - 1)

    skeleton = map_tensors(train_state, take)
    if not tensors:
        return serialize_trainer_state(train_state, where, max_bytes)
    # a copy (CPU tensors too): the trainer may change any of it once the call returns
    return DeferredTrainerState(copy.deepcopy(skeleton), tensors, devices, where, max_bytes)


def on_rank_device(cuda: CudaCalls) -> ToDevice:
    """Where loaded trainer-state tensors that were saved from a GPU go: the rank's current
    CUDA device, whichever device they came from (as `map_location` would put them); when
    this process has no CUDA they stay on the CPU, with a warning.
    Called on: every rank, when loading."""
    if not cuda.available():
        return _stay_on_cpu

    def to_rank_device(t: torch.Tensor, device: int) -> torch.Tensor:
        return cuda.to_device(t, cuda.current_device())

    return to_rank_device


def _stay_on_cpu(t: torch.Tensor, device: int) -> torch.Tensor:
    log.warning(
        "a trainer-state tensor saved from cuda:%d stays on the CPU: CUDA is not available in "
        "this process",
        device,
    )
    return t
