"""Save plans reused while the state keeps its structure (`docs/scale.md`).

DCP plans every save from scratch: each rank builds a write item per entry, the coordinator
gathers every plan, builds the global plan and the metadata, and sends each rank its final
plan. For a state of thousands of entries that is a large part of a save, and it is the same
work every time, because a plan depends only on the state's structure, never on the values.

`ReusingSavePlanner` keeps, per process, what the last saves planned:
- every rank: its local plan and its final plan, under the state's *signature* (every entry's
  key, dtype, shape, layout, flags and, for a DTensor, mesh, placements and local shape; the
  flattening map; the rank, world size and coordinator role), and the *generation* (the id of
  the save whose global plan it took part in);
- the coordinator: the local plans, global plan and metadata of each generation.

A rank whose signature is unchanged sends a token naming its generation instead of its plan.
When every rank sends a token for the coordinator's generation, the coordinator sends tokens
back and every rank writes its cached final plan (with this save's file prefix and save id).
When some ranks send plans, the coordinator plans globally with their new plans and the cached
plans of the others, and every rank receives a full final plan. Any other state, a changed
signature, or a save that failed anywhere (`forget`), means planning from scratch: a stale
plan is never used.

Called on: every rank, inside `dcp.save` (`core/dcp.py`).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint import _version as _dcp_version
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.tensor import DTensor

from trainckpt.errors import CheckpointError

log = logging.getLogger(__name__)

KEPT = 4
"""Signatures (every rank) and generations (coordinator) kept per process: a few models or
checkpointers saving in turn each keep their plans."""

_PLAIN = (torch.Tensor, torch.nn.Parameter)


@dataclass(frozen=True)
class _Token:
    """Sent in place of a plan: "my plan is the one of generation `generation`"."""

    generation: str


@dataclass(frozen=True)
class _LocalEntry:
    local_plan: SavePlan
    final_plan: SavePlan
    generation: str


@dataclass(frozen=True)
class _GlobalEntry:
    local_plans: list[SavePlan]
    global_plan: list[SavePlan]
    metadata: Metadata


counts: Counter[str] = Counter()
"""How many local and global plans this process made ("... planned") or reused ("... reused");
for tests and benchmarks."""
_lock = threading.Lock()
_local: OrderedDict[tuple[Any, ...], _LocalEntry] = OrderedDict()
_global: OrderedDict[str, _GlobalEntry] = OrderedDict()


def forget() -> None:
    """Drop every cached plan of this process (after a failed save: the next save plans from
    scratch on every rank, since every rank sees the failure)."""
    with _lock:
        _local.clear()
        _global.clear()


def _keep(cache: OrderedDict[Any, Any], key: Any, value: Any) -> None:
    with _lock:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > KEPT:
            cache.popitem(last=False)


def state_signature(
    state: dict[str, Any], mappings: dict[str, Any], coordinator: bool, rank: int, world: int
) -> tuple[Any, ...] | None:
    """Everything DCP's local save plan depends on, for the flattened `state`; None when an
    entry is of a kind whose plan this does not describe (ShardedTensor, tensor subclasses):
    such states are planned every time."""
    parts: list[tuple[Any, ...]] = []
    for fqn, obj in state.items():
        if type(obj) in _PLAIN:
            parts.append(
                (fqn, obj.dtype, obj.shape, obj.layout, obj.requires_grad, obj.is_pinned())
            )
        elif type(obj) is DTensor:
            local = obj._local_tensor
            parts.append(
                (fqn, obj.dtype, obj.shape, obj.device_mesh, obj.placements, local.shape,
                 local.layout, local.requires_grad, local.is_pinned())
            )  # fmt: skip
        elif isinstance(obj, torch.Tensor) or hasattr(obj, "__create_write_items__"):
            return None
        else:
            parts.append((fqn,))  # a value written as bytes: its plan names only its key
    return (rank, world, coordinator, tuple(parts), tuple(mappings.items()))


def flatten_nested(
    state: Mapping[Any, Any],
) -> tuple[dict[str, Any], dict[str, tuple[str | int, ...]]] | None:
    """DCP's flattening for a save (`flatten_state_dict`, then `_flatten_sharded_tensors`),
    for the states made only of mappings and leaves other than lists and ShardedTensors: the
    same flat dict, in the same order, and mappings, from one walk instead of DCP's two (each
    of which looks at every value again to tell leaves from lists). None for any other state,
    or a repeated flat key (DCP then flattens it, or names the repeated key)."""
    found = _flatten(state, mappings=True)
    return None if found is None else (found.flat, found.mappings)


@dataclass
class _Flat:
    """What `_flatten` found: the flat state, DCP's mappings (when asked for), and the
    state's shape (`_walk`), or None when an entry is of a kind a shape does not describe."""

    flat: dict[str, Any]
    mappings: dict[str, tuple[str | int, ...]]
    shape: tuple[Any, ...] | None


_LEAVES = frozenset({float, int, bool, str, bytes, type(None), tuple, complex})
"""Leaf types that are neither mappings, lists nor tensors: written as byte items."""
_FAST = _LEAVES | frozenset(_PLAIN)
_STR = frozenset({str})


def _flatten(state: Mapping[Any, Any], mappings: bool) -> _Flat | None:
    """`flatten_nested`'s walk, with the state's shape (`_walk`). `mappings`: also build
    DCP's mappings (else left empty: only a new plan needs them)."""
    if _dcp_version._derived_version == "2_3":
        return None  # DCP's older traversal stops at other places
    found = _Flat({}, {}, None)
    try:
        found.shape = _walk(state, (), "", found, mappings)
    except _NotFlat:
        return None
    return found


class _NotFlat(Exception):
    """A state `flatten_nested` leaves to DCP."""


def _walk(
    mapping: Mapping[Any, Any],
    path: tuple[str, ...],
    prefix: str,
    found: _Flat,
    mappings: bool,
) -> tuple[Any, ...] | None:
    """Flatten one mapping into `found` (depth first, in order, as DCP's) and return its
    shape: everything DCP's local plan depends on besides the rank's place, as (keys, the
    type of each value, the properties of each tensor in order, the shapes of the nested
    mappings in order). A tensor's properties are its dtype, shape, layout, `requires_grad`
    and pinned memory, a DTensor's also its mesh, placements and local tensor's. Keys and
    types give the flat keys and DCP's mappings exactly, so two states of one shape plan
    alike. None when an entry is of a kind the shape does not describe (tensor subclasses
    and the like): such states are planned every time. A mapping of plain dict leaves (the
    flat model and optimizer states) is taken whole, without a step per entry."""
    flat = found.flat
    if type(mapping) is dict:
        keys = tuple(mapping)
        values = list(mapping.values())
        kinds = tuple(map(type, values))
        if _FAST.issuperset(kinds) and _STR.issuperset(map(type, keys)):
            names = [prefix + k for k in keys] if prefix else keys
            size = len(flat)
            flat.update(zip(names, values, strict=True))
            if len(flat) != size + len(keys):
                raise _NotFlat  # a flat key twice
            if mappings:
                found.mappings.update(zip(names, [(*path, k) for k in keys], strict=True))
            attrs = tuple(
                [
                    (v.dtype, v.shape, v.layout, v.requires_grad, v.is_pinned())
                    for v, kind in zip(values, kinds, strict=True)
                    if kind in _PLAIN
                ]
            )
            return keys, kinds, attrs, ()
    return _walk_each(mapping, path, prefix, found, mappings)


def _walk_each(
    mapping: Mapping[Any, Any],
    path: tuple[str, ...],
    prefix: str,
    found: _Flat,
    mappings: bool,
) -> tuple[Any, ...] | None:
    """`_walk` one entry at a time: nested mappings, keys other than str, other values."""
    flat, maps = found.flat, found.mappings
    keys: list[str] = []
    kinds: list[type] = []
    attrs: list[tuple[Any, ...]] = []
    children: list[tuple[Any, ...] | None] = []
    signed = True
    for k, v in mapping.items():
        key = k if type(k) is str else str(k)
        kind = type(v)
        keys.append(key)
        kinds.append(kind)
        if kind is dict or (kind not in _FAST and isinstance(v, Mapping)):
            child = _walk(v, (*path, key), f"{prefix}{key}.", found, mappings)
            children.append(child)
            signed = signed and child is not None
            continue
        name = prefix + key
        if name in flat:
            raise _NotFlat
        flat[name] = v
        if mappings:
            maps[name] = (*path, key)
        if kind in _LEAVES:
            continue
        if kind in _PLAIN:
            attrs.append((v.dtype, v.shape, v.layout, v.requires_grad, v.is_pinned()))
        elif isinstance(v, list | ShardedTensor):
            raise _NotFlat
        elif kind is DTensor:
            local = v._local_tensor
            attrs.append(
                (v.dtype, v.shape, v.device_mesh, v.placements, local.shape, local.layout,
                 local.requires_grad, local.is_pinned())
            )  # fmt: skip
        elif isinstance(v, torch.Tensor) or hasattr(v, "__create_write_items__"):
            signed = False
    if not signed:
        return None
    return tuple(keys), tuple(kinds), tuple(attrs), tuple(children)


class PlanCacheError(CheckpointError):
    """The ranks' cached plans do not belong together (a rank missed a save's outcome)."""


class ReusingSavePlanner(DefaultSavePlanner):
    """DCP's default save planner that reuses the plans of the last save of the same
    structure (module docstring). `rank` and `world` are this rank's place in the group."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self._rank, self._world = rank, world
        self._signature: tuple[Any, ...] | None = None
        self._hit: _LocalEntry | None = None
        self._new_local: SavePlan | None = None
        self._new_global: _GlobalEntry | None = None
        self._nested: dict[str, Any] | None = None  # the state `_flatten` flattened
        self._shape: tuple[Any, ...] | None = None

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        """DCP's own set-up, with the state flattened by `_flatten` when it can (DCP's
        mappings then made only if a new local plan needs them)."""
        self._shape = None
        found = _flatten(state_dict, mappings=False) if self.flatten_state_dict else None
        if found is None or not self.flatten_sharded_tensors:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
            return
        self.state_dict, self.is_coordinator = found.flat, is_coordinator
        self._nested, self._shape = state_dict, found.shape
        self.mappings = {}

    def create_local_plan(self) -> SavePlan:
        if self._nested is not None:
            self._signature = (
                None
                if self._shape is None
                else (self._rank, self._world, self.is_coordinator, self._shape)
            )
        else:
            self._signature = state_signature(
                self.state_dict, self.mappings, self.is_coordinator, self._rank, self._world
            )
        with _lock:
            self._hit = None if self._signature is None else _local.get(self._signature)
        if self._hit is not None:
            counts["local reused"] += 1
            self.plan = self._hit.local_plan
            return SavePlan([], planner_data=_Token(self._hit.generation), usable=False)
        counts["local planned"] += 1
        if self._nested is not None:  # DCP's mappings, for the new plan
            found = _flatten(self._nested, mappings=True)
            assert found is not None and list(found.flat) == list(self.state_dict)
            self.mappings = found.mappings
        self._new_local = super().create_local_plan()
        return self._new_local

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        tokens = {p.planner_data for p in all_plans if isinstance(p.planner_data, _Token)}
        if not tokens:
            return self._plan_globally(all_plans)
        with _lock:
            entry = _global.get(next(iter(tokens)).generation) if len(tokens) == 1 else None
        if entry is None or len(entry.local_plans) != len(all_plans):
            raise PlanCacheError(
                f"the ranks' cached save plans ({sorted(t.generation for t in tokens)}) are not "
                "the coordinator's: a rank missed the outcome of an earlier save. This save "
                "is not written; the next one plans from scratch on every rank"
            )
        if all(isinstance(p.planner_data, _Token) for p in all_plans):
            log.debug("every rank's save plan is unchanged: reusing the global plan")
            counts["global reused"] += 1
            self.global_plan, self.metadata = entry.global_plan, entry.metadata
            tokens_back = [SavePlan([], usable=False) for _ in all_plans]
            return tokens_back, dataclasses.replace(entry.metadata)
        merged = [
            entry.local_plans[i] if isinstance(p.planner_data, _Token) else p
            for i, p in enumerate(all_plans)
        ]
        return self._plan_globally(merged)

    def _plan_globally(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        counts["global planned"] += 1
        plans, metadata = super().create_global_plan(all_plans)
        self._new_global = _GlobalEntry(all_plans, plans, metadata)
        return plans, dataclasses.replace(metadata)  # the writer's `finish` fills in a copy

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not new_plan.usable:  # the coordinator reused the global plan: so does this rank
            if self._hit is None:
                raise PlanCacheError(
                    "the coordinator reused a save plan this rank does not have; the next "
                    "save plans from scratch on every rank"
                )
            final = dataclasses.replace(self._hit.final_plan, storage_data=new_plan.storage_data)
            return super().finish_plan(final)
        generation = getattr(new_plan.storage_data, "save_id", None)
        if isinstance(generation, str) and generation:
            if self._signature is not None:
                local = self._hit.local_plan if self._hit is not None else self._new_local
                assert local is not None
                _keep(_local, self._signature, _LocalEntry(local, new_plan, generation))
            if self._new_global is not None:
                _keep(_global, generation, self._new_global)
        return super().finish_plan(new_plan)
