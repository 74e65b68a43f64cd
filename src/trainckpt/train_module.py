"""What a checkpointer saves and loads: the `TrainModule` protocol and `ModelAndOptim`."""

from __future__ import annotations

import logging
from typing import Any, Protocol, runtime_checkable

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from .errors import CheckpointError

log = logging.getLogger(__name__)


@runtime_checkable
class TrainModule(Protocol):
    """The model-side state of a training run, as DCP state dicts.

    Same shape as OLMo-core's train modules, so either library's checkpointer accepts either's.
    """

    def state_dict_to_save(self) -> dict[str, Any]:
        """The state to save; tensors may be sharded (DTensor)."""
        ...

    def state_dict_to_load(self, metadata: Metadata, optim: bool | None = None) -> dict[str, Any]:
        """A state dict of the right shapes and shardings for DCP to load into, in place.
        `optim=None` loads optimizer state when both the checkpoint and the module have it."""
        ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a state dict that DCP filled in."""
        ...


class ModelAndOptim:
    """A `TrainModule` for one `torch.nn.Module` (plain, DDP or FSDP2) and an optional optimizer.

    State keys are `"model"` and `"optim"` (optimizer state flattened by parameter name), as
    OLMo-core's transformer train module writes them, so checkpoints interchange.
    """

    def __init__(self, model: torch.nn.Module, optim: torch.optim.Optimizer | None = None) -> None:
        self.model = model
        self.optim = optim
        self._options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict_to_save(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": get_model_state_dict(self.model, options=self._options)}
        if self.optim is not None:
            state["optim"] = get_optimizer_state_dict(self.model, self.optim, options=self._options)
        return state

    def state_dict_to_load(self, metadata: Metadata, optim: bool | None = None) -> dict[str, Any]:
        has_optim = any(k.startswith("optim.") for k in metadata.state_dict_metadata)
        if optim is None:
            optim = has_optim and self.optim is not None
            if self.optim is not None and not has_optim:
                log.warning("the checkpoint holds no optimizer state; loading model weights only")
        if optim and not has_optim:
            raise CheckpointError(
                "load_optim_state=True but the checkpoint holds no optimizer state; "
                "pass load_optim_state=False to load the model weights only"
            )
        if optim and self.optim is None:
            raise CheckpointError(
                "load_optim_state=True but this ModelAndOptim has no optimizer; "
                "pass the optimizer to ModelAndOptim(model, optim)"
            )
        state: dict[str, Any] = {"model": get_model_state_dict(self.model, options=self._options)}
        if optim:
            assert self.optim is not None
            state["optim"] = get_optimizer_state_dict(self.model, self.optim, options=self._options)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict["model"], options=self._options)
        if "optim" in state_dict and self.optim is not None:
            set_optimizer_state_dict(
                self.model, self.optim, state_dict["optim"], options=self._options
            )
