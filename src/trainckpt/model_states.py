"""`ModelAndStates`: a `TrainModule` for model parts plus any objects with `state_dict` /
`load_state_dict` (DCP's `Stateful`), in torchtitan's DCP layout.

torchtitan passes an optimizer container, an LR-scheduler container, a stateful data loader and
extra states, none of them a `torch.optim.Optimizer`, so `ModelAndOptim` does not fit. The
layout is torchtitan's, so checkpoints interchange with its own manager: the model's keys at the
top level, merged across parts (pipeline stages keep their original names), and each state under
its name (`optimizer.state.<fqn>.exp_avg`, `lr_scheduler.last_epoch`,
`dataloader.dp_rank_0`, `train_state.step`). Nothing here imports torchtitan.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from trainckpt.core import dist
from trainckpt.errors import CheckpointError, ConfigurationError
from trainckpt.format.safe_unpickle import check_plain_pickles

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger(__name__)


@runtime_checkable
class Stateful(Protocol):
    """What DCP calls `Stateful`: an object that gives and takes a state dict."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


def _is_stateful(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


_PLAIN = (type(None), bool, int, float, str, bytes, torch.Tensor)


def _is_plain(obj: Any) -> bool:
    """A value DCP saves as it is and the safe loaders read back: a tensor, None, a number, a
    string, bytes, or lists, tuples and string-keyed dicts of those."""
    if isinstance(obj, _PLAIN):
        return True
    if isinstance(obj, (list, tuple)):
        return all(_is_plain(v) for v in obj)
    if isinstance(obj, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in obj.items())
    return False


def _unwrap(part: torch.nn.Module) -> torch.nn.Module:
    """The module whose `state_dict` keys are the model's own names: DDP and `torch.compile`
    wrappers add a prefix (`module.`, `_orig_mod.`); FSDP2 adds none."""
    while True:
        inner = getattr(part, "module", None) if _is_ddp(part) else None
        inner = inner or getattr(part, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module):
            return part
        part = inner


def _is_ddp(part: torch.nn.Module) -> bool:
    return type(part).__name__ == "DistributedDataParallel"


def _in_checkpoint(name: str, keys: Iterable[str]) -> bool:
    prefix = name + "."
    return any(k == name or k.startswith(prefix) for k in keys)


class ModelAndStates:
    """A `TrainModule` for model parts and named `Stateful` objects, in torchtitan's layout.

    - `model`: one module or a list of parts; their `state_dict()` keys are merged and must be
      unique across parts. Saved at the top level of the DCP state, loaded back into each part
      with its own keys (strict), so a checkpoint of N parts loads into any other split.
    - `states`: name -> object with `state_dict()`/`load_state_dict()`, or a plain value (a
      tensor, None, a number, a string, or lists and dicts of those), as torchtitan's manager
      takes them. Each is saved under its name, a plain value as it is (a `dataloader=None`
      entry too, so torchtitan's manager finds the key it expects); a name must not collide with
      a model key. On load a tensor is filled in place; another plain value is replaced in
      `states` (torchtitan restores neither: it loads them into a copy).
    - `optim_keys`: the states that `load(..., load_optim_state=False)` leaves alone (and that a
      step-0 seed checkpoint lacks). Default `("optimizer",)`.
    - `per_rank`: states whose value differs by rank with the same keys on every rank (a plain
      stateful data loader, an RNG). Saved under `<name>.rank<R>` so no rank's value is
      deduplicated away; on load each rank takes its own, or rank 0's with a warning when the
      checkpoint was written by fewer ranks. (torchtitan's data loader needs none of this: it
      keys its state by data-parallel rank itself.)

    Loading never runs code from the checkpoint: DCP values are read as plain data, and pickled
    bytes inside a state (torchtitan's data loader keeps its position as `pickle.dumps` bytes and
    unpickles them in `load_state_dict`) are vetted as plain data before any object sees them.

    Called on: all ranks (build it on each, with that rank's objects).
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        states: Mapping[str, Any] | None = None,
        *,
        optim_keys: Sequence[str] = ("optimizer",),
        per_rank: Sequence[str] = (),
        rank: int | None = None,
    ) -> None:
        self.parts: list[torch.nn.Module] = (
            list(model) if isinstance(model, (list, tuple)) else [model]  # type: ignore[list-item]
        )
        if not self.parts:
            raise ConfigurationError("ModelAndStates needs at least one model part")
        self.states: dict[str, Any] = dict(states or {})
        self.optim_keys = tuple(optim_keys)
        self.per_rank = tuple(per_rank)
        self.rank = dist.get_rank() if rank is None else rank
        for name, obj in self.states.items():
            if not _is_stateful(obj) and not _is_plain(obj):
                raise ConfigurationError(
                    f"state '{name}' ({type(obj).__name__}) has no state_dict/load_state_dict "
                    "and is no plain value; pass objects that DCP calls Stateful, tensors, or "
                    "plain data (None, numbers, strings, lists and dicts of them)"
                )
        unknown = sorted(set(self.per_rank) - set(self.states))
        if unknown:
            raise ConfigurationError(f"per_rank names {unknown}, which are not among the states")
        plain = sorted(n for n in self.per_rank if not _is_stateful(self.states[n]))
        if plain:
            raise ConfigurationError(f"per_rank names {plain}, which are not Stateful objects")
        self._check_names()

    def _part_keys(self) -> list[list[str]]:
        return [list(_unwrap(p).state_dict().keys()) for p in self.parts]

    def _check_names(self) -> None:
        seen: dict[str, int] = {}
        for i, keys in enumerate(self._part_keys()):
            for key in keys:
                if key in seen:
                    raise ConfigurationError(
                        f"model key '{key}' is in part {seen[key]} and part {i}: names must be "
                        "unique across parts (keep each stage's original names)"
                    )
                seen[key] = i
        for name in self.states:
            if _in_checkpoint(name, seen):
                raise ConfigurationError(
                    f"state name '{name}' collides with the model's keys (model keys are saved "
                    "at the top level): rename the state"
                )

    # -- the model ------------------------------------------------------------------------------
    def model_state(self) -> dict[str, Any]:
        """The model's state, merged across parts (tensors may be DTensors)."""
        return {k: v for p in self.parts for k, v in _unwrap(p).state_dict().items()}

    def weights(self, dtype: torch.dtype | None = None) -> ModelStatesWeights:
        """A `TrainModule` that saves the model only, floating tensors cast to `dtype`."""
        return ModelStatesWeights(self, dtype)

    # -- TrainModule ----------------------------------------------------------------------------
    def _state_of(self, name: str) -> Any:
        obj = self.states[name]
        if not _is_stateful(obj):
            return obj  # a plain value is saved (and loaded into) as it is
        state = obj.state_dict()
        if name in self.per_rank:
            return {f"rank{self.rank}": state}
        return state

    def state_dict_to_save(self) -> dict[str, Any]:
        state = self.model_state()
        for name in self.states:
            state[name] = self._state_of(name)
        return state

    def state_dict_to_load(self, metadata: Metadata, optim: bool | None = None) -> dict[str, Any]:
        keys = metadata.state_dict_metadata.keys()
        state = self.model_state()
        for name in self.states:
            is_optim = name in self.optim_keys
            if is_optim and optim is False:
                continue
            if not _in_checkpoint(name, keys):
                if is_optim and optim:
                    raise CheckpointError(
                        f"load_optim_state=True but the checkpoint holds no '{name}' state; "
                        "pass load_optim_state=False to load without it"
                    )
                log.warning("the checkpoint holds no '%s' state; leaving it as it is", name)
                continue
            value = self._state_of(name)
            if name in self.per_rank:
                value = self._per_rank_to_load(name, value, keys)
            state[name] = value
        return state

    def _per_rank_to_load(self, name: str, value: dict[str, Any], keys: Iterable[str]) -> Any:
        own = f"rank{self.rank}"
        if _in_checkpoint(f"{name}.{own}", keys):
            return value
        log.warning(
            "the checkpoint holds no '%s' state of rank %d (it was saved by fewer ranks): "
            "loading rank 0's",
            name,
            self.rank,
        )
        return {"rank0": value[own]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply what DCP filled in: each part strictly with its own keys, then each state
        present in `state_dict` (states left out, e.g. by `exclude`, stay untouched)."""
        for part, keys in zip(self.parts, self._part_keys(), strict=True):
            _unwrap(part).load_state_dict({k: state_dict[k] for k in keys}, strict=True)
        for name, obj in self.states.items():
            if name not in state_dict:
                continue
            value = state_dict[name]
            if not _is_stateful(obj):
                if isinstance(obj, torch.Tensor) and isinstance(value, torch.Tensor):
                    if value is not obj:
                        obj.copy_(value)
                else:
                    self.states[name] = value
                continue
            if name in self.per_rank:
                value = next(iter(value.values()))
            check_plain_pickles(value, name)
            obj.load_state_dict(value)


class ModelStatesWeights:
    """A `TrainModule` that saves only the model of a `ModelAndStates` (flat keys, as
    torchtitan's model-only final save), floating tensors cast to `dtype`; loads like any
    checkpoint into the model."""

    def __init__(self, module: ModelAndStates, dtype: torch.dtype | None = None) -> None:
        self.module = module
        self.dtype = dtype

    def state_dict_to_save(self) -> dict[str, Any]:
        return {
            k: v.to(self.dtype)
            if self.dtype is not None and isinstance(v, torch.Tensor) and v.is_floating_point()
            else v
            for k, v in self.module.model_state().items()
        }

    def state_dict_to_load(self, metadata: Metadata, optim: bool | None = None) -> dict[str, Any]:
        return self.module.model_state()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.module.load_state_dict(state_dict)
