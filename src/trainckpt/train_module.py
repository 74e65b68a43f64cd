"""What a checkpointer saves and loads: the `TrainModule` protocol, `ModelAndOptim` and
`ModelWeights` (a model-only view, optionally in a smaller dtype)."""

from __future__ import annotations

import logging
from collections.abc import Container, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from trainckpt import plain_state
from trainckpt.errors import CheckpointError, ConfigurationError

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

log = logging.getLogger(__name__)


def _sd() -> Any:
    """`torch.distributed.checkpoint.state_dict`, imported on first use: importing DCP (and
    DTensor with it) takes about a second, which `import trainckpt` should not cost."""
    import torch.distributed.checkpoint.state_dict as sd

    return sd


def _opts() -> Any:
    return _sd().StateDictOptions(flatten_optimizer_state_dict=True)


def get_model_state_dict(*args: Any, **kwargs: Any) -> Any:
    return _sd().get_model_state_dict(*args, **kwargs)


def get_optimizer_state_dict(*args: Any, **kwargs: Any) -> Any:
    return _sd().get_optimizer_state_dict(*args, **kwargs)


def get_state_dict(*args: Any, **kwargs: Any) -> Any:
    return _sd().get_state_dict(*args, **kwargs)


def set_model_state_dict(*args: Any, **kwargs: Any) -> Any:
    return _sd().set_model_state_dict(*args, **kwargs)


def set_optimizer_state_dict(*args: Any, **kwargs: Any) -> Any:
    return _sd().set_optimizer_state_dict(*args, **kwargs)


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


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


class ModelAndOptim:
    """A `TrainModule` for a model (plain, DDP or FSDP2) and its optimizer, or for several
    model parts (pipeline-parallel stages) with one optimizer each.

    State keys are `"model"` (parameter names, unique across parts) and `"optim"` (optimizer
    state flattened by parameter name), as OLMo-core's transformer train module writes them,
    so checkpoints interchange — and a checkpoint of N parts loads into any other split of the
    same model, one part included.
    """

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        optim: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
    ) -> None:
        self.parts: list[torch.nn.Module] = _as_list(model)
        self.optims: list[torch.optim.Optimizer] = [] if optim is None else _as_list(optim)
        if not self.parts:
            raise ConfigurationError("ModelAndOptim needs at least one model part")
        if self.optims and len(self.optims) != len(self.parts):
            raise ConfigurationError(
                f"ModelAndOptim got {len(self.parts)} model parts and {len(self.optims)} "
                "optimizers: pass one optimizer per part (or none)"
            )
        self._check_unique_names()
        self._handed_out: _HandedOut | None = None

    @property
    def model(self) -> torch.nn.Module:
        """The model, when there is one part."""
        if len(self.parts) != 1:
            raise AttributeError("this ModelAndOptim has several parts: use .parts")
        return self.parts[0]

    @property
    def optim(self) -> torch.optim.Optimizer | None:
        """The optimizer, when there is one part (None without optimizer)."""
        if len(self.optims) > 1:
            raise AttributeError("this ModelAndOptim has several optimizers: use .optims")
        return self.optims[0] if self.optims else None

    def weights(self, dtype: torch.dtype | None = None) -> ModelWeights:
        """A `TrainModule` that saves the model weights only, floating tensors cast to `dtype`."""
        return ModelWeights(self, dtype)

    def _check_unique_names(self) -> None:
        seen: dict[str, int] = {}
        for i, part in enumerate(self.parts):
            for name in part.state_dict():
                if name in seen:
                    raise ConfigurationError(
                        f"state key '{name}' is in model part {seen[name]} and part {i}: "
                        "parameter names must be unique across parts (keep each stage's "
                        "original names, as torchtitan's pipeline split does)"
                    )
                seen[name] = i

    def _model_state(self) -> dict[str, Any]:
        return _merged([part.model for part in self._parts(optim=False)])

    def _parts(self, optim: bool, saved: Container[str] | None = None) -> list[_Part]:
        """Each part's model state dict, and with `optim` its flattened optimizer state, as
        DCP's `get_state_dict(..., flatten_optimizer_state_dict=True)` returns them: from
        one plain walk where `plain_state` can be sure that is what DCP returns, else from
        DCP. DCP fills the state of an optimizer that has not stepped yet by stepping it with
        zero gradients (its step counter becomes 1); that state is returned but taken off
        the optimizer again, so saving never changes how training goes on. `saved`: the flat
        keys of the checkpoint to load (`plain_state.flat_optim`)."""
        optims = self.optims if optim else []
        fresh = [not o.state for o in optims]
        try:
            return [
                _part(i, p, optims[i] if optims else None, saved) for i, p in enumerate(self.parts)
            ]
        finally:
            for o, was_fresh in zip(optims, fresh, strict=True):
                if was_fresh:
                    o.state.clear()

    def state_dict_to_save(self) -> dict[str, Any]:
        """Model and optimizer state of every part, one walk of each (DCP's `get_state_dict`
        where the plain walk does not apply: it maps parameter names once for both). An
        optimizer that has not stepped yet is left without state, as `_parts` leaves it."""
        parts = self._parts(optim=bool(self.optims))
        state = {"model": _merged([p.model for p in parts])}
        if self.optims:
            state["optim"] = _merged([p.optim or {} for p in parts])
        return state

    def state_dict_to_load(self, metadata: Metadata, optim: bool | None = None) -> dict[str, Any]:
        has_optim = any(k.startswith("optim.") for k in metadata.state_dict_metadata)
        if optim is None:
            optim = has_optim and bool(self.optims)
            if self.optims and not has_optim:
                log.warning("the checkpoint holds no optimizer state; loading model weights only")
        if optim and not has_optim:
            raise CheckpointError(
                "load_optim_state=True but the checkpoint holds no optimizer state; "
                "pass load_optim_state=False to load the model weights only"
            )
        if optim and not self.optims:
            raise CheckpointError(
                "load_optim_state=True but this ModelAndOptim has no optimizer; "
                "pass the optimizer to ModelAndOptim(model, optim)"
            )
        parts = self._parts(optim=optim, saved=metadata.state_dict_metadata)
        state: dict[str, Any] = {"model": _merged([p.model for p in parts])}
        if optim:
            state["optim"] = _merged([p.optim or {} for p in parts])
        self._handed_out = _HandedOut(state, parts)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Apply a state dict DCP filled in. For the dict `state_dict_to_load` handed out,
        a part it walked plainly gets only what in-place loading did not do (extra states,
        the optimizer's `param_groups` and state dict), as `plain_state` describes; anything
        else goes through DCP's `set_model_state_dict`/`set_optimizer_state_dict`."""
        model_sd = state_dict.get("model")
        optim_sd = state_dict.get("optim") if self.optims else None
        handed_out, self._handed_out = self._handed_out, None
        for i, part in enumerate(self.parts):
            if model_sd is not None:
                plain = handed_out.plain(model_sd, i) if handed_out else None
                reason = "not the state dict handed out" if plain is None else None
                if plain is not None:
                    reason = plain_state.apply_model(plain, model_sd)
                if reason is not None:
                    if plain is not None:
                        log.debug("part %d: model loaded by DCP: %s", i, reason)
                    own = handed_out.model_keys(model_sd, i) if handed_out else None
                    if own is None:
                        own = list(get_model_state_dict(part, options=_opts()))
                    set_model_state_dict(part, {k: model_sd[k] for k in own}, options=_opts())
            if optim_sd is not None:
                self._load_optim(i, optim_sd, handed_out)

    def _load_optim(self, i: int, optim_sd: Any, handed_out: _HandedOut | None) -> None:
        part, optim = self.parts[i], self.optims[i]
        plain = handed_out.plain_optim(optim_sd, i) if handed_out else None
        if plain is not None:
            groups = plain_state.groups_to_load(optim, plain, optim_sd)
            if not isinstance(groups, str):
                plain_state.init_optim_state(optim)  # as DCP's set_optimizer_state_dict
                state = plain_state.state_to_load(optim, plain, optim_sd)
                if not isinstance(state, str):
                    plain_state.load_optim(optim, state, groups)
                    return
                groups = state
            log.debug("part %d: optimizer loaded by DCP: %s", i, groups)
        own = handed_out.optim_keys(optim_sd, i) if handed_out else None
        if own is None:
            own = list(get_optimizer_state_dict(part, optim, options=_opts()))
        set_optimizer_state_dict(part, optim, {k: optim_sd[k] for k in own}, options=_opts())


class _Part:
    """One model part's state dicts, and the plain walk they came from (None: from DCP;
    `optim_plain`: the optimizer state too)."""

    def __init__(
        self,
        model: dict[str, Any],
        optim: dict[str, Any] | None,
        plain: plain_state.PlainPart | None = None,
        optim_plain: bool = False,
    ) -> None:
        self.model = model
        self.optim = optim
        self.plain = plain
        self.optim_plain = optim_plain


def _part(
    i: int,
    module: torch.nn.Module,
    optim: torch.optim.Optimizer | None,
    saved: Container[str] | None = None,
) -> _Part:
    """Part `i`'s state dicts (see `ModelAndOptim._parts`); logs which way they were made."""
    walked = plain_state.walk(module)
    reason = walked if isinstance(walked, str) else None
    if reason is None and optim is not None:
        assert not isinstance(walked, str)
        reason = plain_state.optim_reason(optim, walked)
        if reason is None:
            plain_state.init_optim_state(optim)  # as DCP's get_optimizer_state_dict
            reason = plain_state.state_reason(optim, walked)
    if reason is None:
        assert not isinstance(walked, str)
        log.debug("part %d: state dicts from a plain walk", i)
        flat = None if optim is None else plain_state.flat_optim(optim, walked, saved, "optim.")
        return _Part(walked.model, flat, walked, optim is not None)
    log.debug("part %d: state dicts from DCP: %s", i, reason)
    if optim is None:
        return _Part(get_model_state_dict(module, options=_opts()), None)
    model, flat = get_state_dict(module, optim, options=_opts())
    return _Part(model, flat)


def _merged(parts: list[dict[str, Any]]) -> dict[str, Any]:
    if len(parts) == 1:
        return dict(parts[0])  # one copy in C: tens of thousands of entries
    return {k: v for part in parts for k, v in part.items()}


class _HandedOut:
    """The state dict `state_dict_to_load` last returned and the keys of each part in it, so
    that `load_state_dict` of that same dict splits it by part without building every part's
    state dict again (a second full walk of DCP's `get_*_state_dict` per load), and finds
    the plain walk of each part that had one."""

    def __init__(self, state: dict[str, Any], parts: list[_Part]) -> None:
        self.model = state["model"]
        self.optim = state.get("optim")
        self.parts = parts

    def model_keys(self, model_sd: Any, part: int) -> list[str] | None:
        """Part `part`'s keys, if `model_sd` is the model state handed out; else None."""
        return list(self.parts[part].model) if model_sd is self.model else None

    def optim_keys(self, optim_sd: Any, part: int) -> list[str] | None:
        """Part `part`'s optimizer keys, if `optim_sd` is the optimizer state handed out."""
        if optim_sd is not self.optim or self.parts[part].optim is None:
            return None
        return list(self.parts[part].optim or {})

    def plain(self, model_sd: Any, part: int) -> plain_state.PlainPart | None:
        """Part `part`'s plain walk, if `model_sd` is the model state handed out."""
        return self.parts[part].plain if model_sd is self.model else None

    def plain_optim(self, optim_sd: Any, part: int) -> plain_state.PlainPart | None:
        """Part `part`'s plain walk, if `optim_sd` is the optimizer state handed out and
        the walk made it."""
        p = self.parts[part]
        return p.plain if optim_sd is self.optim and p.optim_plain else None


class ModelWeights:
    """A `TrainModule` that saves only the model weights of `module`, floating-point tensors
    cast to `dtype` when given: the small final checkpoint of a run. It loads like any other
    checkpoint (`Checkpointer.load` into a `ModelAndOptim` of that dtype loads the weights)."""

    def __init__(self, module: ModelAndOptim, dtype: torch.dtype | None = None) -> None:
        self.module = module
        self.dtype = dtype

    def _cast(self, t: Any) -> Any:
        if self.dtype is not None and isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.to(self.dtype)
        return t

    def state_dict_to_save(self) -> dict[str, Any]:
        return {"model": {k: self._cast(v) for k, v in self.module._model_state().items()}}

    def state_dict_to_load(self, metadata: Metadata, optim: bool | None = None) -> dict[str, Any]:
        return self.module.state_dict_to_load(metadata, optim=False)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.module.load_state_dict(state_dict)
