"""Model and optimizer state dicts of plain modules in one walk, without DCP's helpers.

For a module tree with no parallel wrapper (DDP, FSDP, `torch.compile`, activation
checkpointing, composable APIs), no DTensor or tensor subclass, no state-dict hook and no
class overriding how state dicts are made or loaded, DCP's `get_state_dict(...,
flatten_optimizer_state_dict=True)` returns exactly `module.state_dict()` under its own names
and the optimizer state flattened by each parameter's first name in `named_parameters()`;
and after DCP loads in place into those tensors, its `set_*_state_dict` changes only what
in-place loading cannot: extra states (`set_extra_state`) and the optimizer's
`param_groups` (through `Optimizer.load_state_dict`). DCP gets there through a name lookup
per parameter (`_get_fqns`) several times per call, and `Optimizer.load_state_dict` scans a
list of every parameter name per state value: seconds at tens of thousands of entries
(docs/scale.md). Here one walk per part gives the same dicts and the same loaded state.

Anything this cannot be sure of returns a reason (a string) instead, and the caller
(`train_module.ModelAndOptim`) uses DCP. Called on: every rank, on its own model parts.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Container
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from trainckpt.identity import identity

_EXTRA = "_extra_state"
# Module methods whose override changes what a state dict holds or how it loads, or which
# names DCP finds (it walks `named_parameters`).
_MODULE_METHODS = (
    "state_dict",
    "load_state_dict",
    "_save_to_state_dict",
    "_load_from_state_dict",
    "named_parameters",
    "named_buffers",
    "named_modules",
    "named_children",
    "_named_members",
)
_MODULE_HOOKS = (
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_OPTIM_HOOKS = (
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)
# FSDP2 makes a class per module: weak keys let them go with their modules
_class_reasons: weakref.WeakKeyDictionary[type, str | None] = weakref.WeakKeyDictionary()


@dataclass
class PlainPart:
    """One walk of a model part: its state dict as DCP returns it (same keys, order and
    values: `detach()`ed parameters and persistent buffers, extra states), each parameter's
    name as DCP maps optimizer state to it, and the module of each extra state."""

    model: dict[str, Any] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)  # identity(parameter) -> first name
    params: dict[int, torch.Tensor] = field(default_factory=dict)  # held: keeps `names` valid
    extra: dict[str, nn.Module] = field(default_factory=dict)


def _wrappers() -> tuple[type, ...]:
    """Wrapper classes under which state-dict names differ from DCP's FQNs."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import ActivationWrapper
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    found: list[type] = [ActivationWrapper, FSDPModule, FSDP, DDP]
    try:
        from torch._dynamo.eval_frame import OptimizedModule

        found.append(OptimizedModule)
    except ImportError:  # pragma: no cover - torch without dynamo
        pass
    return tuple(found)


def _class_reason(cls: type) -> str | None:
    """Why modules of class `cls` need DCP, or None; cached per class."""
    if cls in _class_reasons:
        return _class_reasons[cls]
    reason = None
    if issubclass(cls, _wrappers()):
        reason = f"{cls.__name__} is a parallel/compile/checkpoint wrapper"
    for name in _MODULE_METHODS:
        if reason is None and getattr(cls, name, None) is not getattr(nn.Module, name):
            reason = f"{cls.__name__} overrides {name}"
    get_extra = getattr(cls, "get_extra_state", None) is not nn.Module.get_extra_state
    set_extra = getattr(cls, "set_extra_state", None) is not nn.Module.set_extra_state
    if reason is None and get_extra != set_extra:
        reason = f"{cls.__name__} overrides only one of get_extra_state/set_extra_state"
    if reason is None and hasattr(cls, "_fqn_modifiers"):
        reason = f"{cls.__name__} has _fqn_modifiers"
    _class_reasons[cls] = reason
    return reason


def _tensor_reason(t: torch.Tensor, key: str, kinds: tuple[type, ...]) -> str | None:
    if type(t) not in kinds:
        return f"'{key}' is a {type(t).__name__}"
    if t.is_meta:
        return f"'{key}' is on the meta device"
    return None


@torch.no_grad()
def walk(module: nn.Module) -> PlainPart | str:
    """`module`'s state dict and parameter names in one walk, or why DCP must make them.

    Walks as `Module.state_dict` does (pre-order, a shared submodule under each of its names);
    a tied parameter keeps the first of its names, as `named_parameters()` gives it."""
    from torch.distributed._composable.contract import REGISTRY_KEY

    if torch.__future__.get_swap_module_params_on_conversion():
        return "torch.__future__ swaps module parameters on load"
    part = PlainPart()
    model, names, params, extra = part.model, part.names, part.params, part.extra
    stack: list[tuple[str, nn.Module]] = [("", module)]
    while stack:
        prefix, m = stack.pop()
        reason = _class_reason(type(m))
        if reason is not None:
            return reason
        d = m.__dict__
        for hooks in _MODULE_HOOKS:
            if d.get(hooks):
                return f"module '{prefix[:-1]}' has a {hooks[1:]} hook"
        if REGISTRY_KEY in d or "_fqn_modifiers" in d:
            return f"module '{prefix[:-1]}' has a composable API or _fqn_modifiers"
        if any(n in d for n in _MODULE_METHODS):
            return f"module '{prefix[:-1]}' has a patched state-dict method"
        for name, p in m._parameters.items():
            if p is None:
                continue
            key = prefix + name
            reason = _tensor_reason(p, key, (nn.Parameter,))
            if reason is not None:
                return reason
            model[key] = p.detach()
            key_of_p = identity(p)
            if key_of_p not in names:
                names[key_of_p] = key
                params[key_of_p] = p
        non_persistent = m._non_persistent_buffers_set
        for name, b in m._buffers.items():
            if b is None or name in non_persistent:
                continue
            key = prefix + name
            reason = _tensor_reason(b, key, (torch.Tensor, nn.Parameter))
            if reason is not None:
                return reason
            model[key] = b.detach()
        if type(m).get_extra_state is not nn.Module.get_extra_state:
            key = prefix + _EXTRA
            model[key] = m.get_extra_state()
            extra[key] = m
        children = [(f"{prefix}{n}.", c) for n, c in m._modules.items() if c is not None]
        stack.extend(reversed(children))
    if not model:
        return "the model has no state (DCP raises)"
    if any("_checkpoint_wrapped_module" in k for k in model):
        return "a name holds '_checkpoint_wrapped_module'"
    return part


def optim_reason(optim: torch.optim.Optimizer, part: PlainPart) -> str | None:
    """Why `optim` needs DCP, or None. Checks what does not depend on its state; call
    `state_reason` after `init_optim_state` (which leaves a state it finds alone)."""
    cls = type(optim)
    for name in ("state_dict", "load_state_dict"):
        if getattr(cls, name) is not getattr(torch.optim.Optimizer, name):
            return f"{cls.__name__} overrides {name}"
        if name in optim.__dict__:
            return f"the optimizer's {name} is patched"
    for hooks in _OPTIM_HOOKS:
        if getattr(optim, hooks, None):
            return f"the optimizer has a {hooks[11:]} hook"
    for group in optim.param_groups:
        if not group["params"]:
            return "the optimizer has a parameter group without parameters"
        for p in group["params"]:
            if identity(p) not in part.names:
                return "the optimizer holds a parameter that is not in the model"
    return None


def state_reason(optim: torch.optim.Optimizer, part: PlainPart) -> str | None:
    """Why `optim.state` needs DCP (a value DCP's flattening rejects or nests), or None."""
    in_groups = {identity(p) for g in optim.param_groups for p in g["params"]}
    for p, state in optim.state.items():
        if identity(p) not in in_groups or not isinstance(state, dict):
            return "the optimizer has state that is not a parameter's"
        for v in state.values():
            if not isinstance(v, (torch.Tensor, int, float)):
                return f"the optimizer has a state value of type {type(v).__name__}"
            if isinstance(v, torch.Tensor) and type(v) is not torch.Tensor:
                return f"the optimizer has a state value of type {type(v).__name__}"
    return None


def init_optim_state(optim: torch.optim.Optimizer) -> None:
    """DCP's own `_init_optim_state`: an optimizer that has not stepped is stepped once with
    zero gradients and learning rate 0, so its state exists to save or load into."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    with torch.no_grad():
        _init_optim_state(optim)


def flat_optim(
    optim: torch.optim.Optimizer,
    part: PlainPart,
    saved: Container[str] | None = None,
    under: str = "",
) -> dict[str, Any]:
    """`optim`'s state flattened by parameter name, as DCP's `_flatten_optim_state_dict`
    does: `state.<name>.<key>` in the order of `optim.state`, then
    `param_groups.<name>.<key>` per group and parameter (the same value objects).

    To load a checkpoint whose flat keys are `saved` (this state's under `under`): a group's
    parameters after its first get only their first group key. The others are values
    loading never reads: DCP's `_unflatten_optim_state_dict` (and `groups_to_load`) takes
    each group's values from its first parameter and only looks for the first key of the
    others. An optimizer holds about ten such values per parameter, most of the entries of
    its state. A key that `saved` lacks stays in, so that the load refuses it by name as
    before."""
    names = part.names
    flat: dict[str, Any] = {}
    for p, state in optim.state.items():
        prefix = f"state.{names[identity(p)]}."
        for k, v in state.items():
            flat[f"{prefix}{k}"] = v
    for group in optim.param_groups:
        items = [(k, v) for k, v in group.items() if k != "params"]
        for i, p in enumerate(group["params"]):
            prefix = f"param_groups.{names[identity(p)]}."
            if saved is None or i == 0:
                for k, v in items:
                    flat[prefix + k] = v
                continue
            held = under + prefix
            for j, (k, v) in enumerate(items):
                if j == 0 or held + k not in saved:
                    flat[prefix + k] = v
    return flat


def apply_model(part: PlainPart, loaded: dict[str, Any]) -> str | None:
    """Finish loading `loaded` (the part's handed-out state dict, filled in place) as
    `Module.load_state_dict` would: every tensor is already the live one, so only extra
    states are set. Returns why DCP must load instead (nothing applied then)."""
    for key, handed in part.model.items():
        if key not in loaded:
            return f"'{key}' was not loaded"
        if key not in part.extra and loaded[key] is not handed:
            return f"'{key}' was loaded into a new object, not in place"
    for key, module in part.extra.items():
        module.set_extra_state(loaded[key])
    return None


def _ids(optim: torch.optim.Optimizer) -> list[int]:
    """Parameter ids 0..n-1, the same int objects for `state` and `param_groups`."""
    return list(range(sum(len(g["params"]) for g in optim.param_groups)))


def groups_to_load(
    optim: torch.optim.Optimizer, part: PlainPart, loaded: dict[str, Any]
) -> list[dict[str, Any]] | str:
    """The `param_groups` DCP's `_unflatten_optim_state_dict` makes of `loaded`: each group
    takes the values of its first parameter's keys. Parameter ids are indices, as
    `Optimizer.state_dict` has them (DCP uses names; `Optimizer.load_state_dict` only matches
    ids between `state` and `param_groups`). Returns why DCP must load instead."""
    names = part.names
    groups: list[dict[str, Any]] = []
    ids = _ids(optim)
    index = 0
    for group in optim.param_groups:
        keys = [k for k in group if k != "params"]
        try:
            first = names[identity(group["params"][0])]
            saved = {k: loaded[f"param_groups.{first}.{k}"] for k in keys}
            for p in group["params"]:  # DCP drops a tied parameter's name without a group key
                if keys and f"param_groups.{names[identity(p)]}.{keys[0]}" not in loaded:
                    return f"param_groups.{names[identity(p)]}.{keys[0]} was not loaded"
        except KeyError as e:
            return f"{e.args[0]} was not loaded"
        n = len(group["params"])
        groups.append({"params": ids[index : index + n], **saved})
        index += n
    return groups


def state_to_load(
    optim: torch.optim.Optimizer, part: PlainPart, loaded: dict[str, Any]
) -> dict[int, dict[str, Any]] | str:
    """The `state` DCP's `_unflatten_optim_state_dict` makes of `loaded` (call after
    `init_optim_state`, as DCP does): for every parameter that requires grad, in group order,
    the loaded value of each key its current state has (an empty dict without state); keyed
    by the indices `groups_to_load` gives. Returns why DCP must load instead."""
    names = part.names
    state: dict[int, dict[str, Any]] = {}
    ids = _ids(optim)
    index = 0
    for group in optim.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                prefix = f"state.{names[identity(p)]}."
                values = {}
                for k in optim.state.get(p, ()):
                    if prefix + str(k) not in loaded:
                        return f"{prefix}{k} was not loaded"
                    values[k] = loaded[prefix + str(k)]
                state[ids[index]] = values
            index += 1
    return state


def load_optim(
    optim: torch.optim.Optimizer,
    state: dict[int, dict[str, Any]],
    groups: list[dict[str, Any]],
) -> None:
    """`optim.load_state_dict({"state": state, "param_groups": groups})` without its scan of
    every group's parameter list per state value (quadratic in the parameter count): the
    same casts (`Optimizer._process_value_according_to_param_policy`), the same new state
    and groups, the same `__setstate__`. For values that are tensors or numbers (what
    `state_reason` lets through); anything else goes through `Optimizer.load_state_dict`,
    as does an optimizer that has gained a load hook since its state dict was handed out."""
    if any(getattr(optim, h, None) for h in _OPTIM_HOOKS[2:]):
        optim.load_state_dict({"state": state, "param_groups": groups})
        return
    current = optim.param_groups
    # `deepcopy(groups)` (one memo: shared values stay shared), each parameter list of ints
    # (`groups_to_load`'s, one per group) copied as a list, not int by int
    memo: dict[int, Any] = {}
    saved_groups = [
        {k: list(v) if k == "params" else deepcopy(v, memo) for k, v in g.items()} for g in groups
    ]
    if len(current) != len(saved_groups) or any(
        len(g["params"]) != len(s["params"]) for g, s in zip(current, saved_groups, strict=True)
    ):  # cannot happen: `groups_to_load` made them from `current`; the optimizer raises
        optim.load_state_dict({"state": state, "param_groups": groups})
        return
    id_map: dict[int, tuple[torch.Tensor, dict[str, Any]]] = {}
    for g, s in zip(current, groups, strict=True):
        for i, p in zip(s["params"], g["params"], strict=True):
            id_map[i] = (p, s)
    new_state: defaultdict[torch.Tensor, dict[Any, Any]] = defaultdict(dict)
    tensor, numbers = torch.Tensor, (int, float)
    for i, values in state.items():
        p, s = id_map[i]
        cast: dict[Any, Any] = {}
        floating = dtype = device = None  # of `p`, looked up once per parameter
        for key, v in values.items():
            if isinstance(v, tensor):
                if device is None:
                    device, dtype, floating = p.device, p.dtype, p.is_floating_point()
                if key == "step":
                    if s.get("capturable", False) or s.get("fused", False):
                        v = v.to(dtype=torch.float32, device=device)
                elif floating:
                    if v.dtype != dtype or v.device != device:  # else `to` returns `v`
                        v = v.to(dtype=dtype, device=device)
                elif v.device != device:
                    v = v.to(device=device)
            elif not isinstance(v, numbers):  # nothing changed yet: the optimizer's own way
                optim.load_state_dict({"state": state, "param_groups": groups})
                return
            cast[key] = v
        new_state[p] = cast
    for g, s in zip(current, saved_groups, strict=True):
        s["params"] = g["params"]
        if "param_names" in g and "param_names" not in s:
            s["param_names"] = g["param_names"]
    optim.__setstate__({"state": new_state, "param_groups": saved_groups})
