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

Planning from scratch makes DCP's plans and metadata, item for item, with less work per entry
than DCP's helpers (`local_save_plan`, `global_save_plan`; `docs/scale.md`, "The first save
plans with less work per entry").

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
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.tensor import DTensor

from trainckpt.errors import CheckpointError
from trainckpt.format.tensor_flags import is_pinned

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
            parts.append((fqn, obj.dtype, obj.shape, obj.layout, obj.requires_grad, is_pinned(obj)))
        elif type(obj) is DTensor:
            local = obj._local_tensor
            parts.append(
                (fqn, obj.dtype, obj.shape, obj.device_mesh, obj.placements, local.shape,
                 local.layout, local.requires_grad, is_pinned(local))
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
                    (v.dtype, v.shape, v.layout, v.requires_grad, is_pinned(v))
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
            attrs.append((v.dtype, v.shape, v.layout, v.requires_grad, is_pinned(v)))
        elif isinstance(v, list | ShardedTensor):
            raise _NotFlat
        elif kind is DTensor:
            local = v._local_tensor
            attrs.append(
                (v.dtype, v.shape, v.device_mesh, v.placements, local.shape, local.layout,
                 local.requires_grad, is_pinned(local))
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
        if self.flatten_state_dict and not getattr(self, "_enable_plan_caching", False):
            self._new_local = local_save_plan(self.state_dict, self.mappings)
            self.plan = self._new_local
        else:
            self._new_local = super().create_local_plan()
        return self._new_local

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        """DCP's global planning (`DefaultSavePlanner._create_global_plan`: deduplication,
        metadata, merged mappings, validation) through `global_save_plan`."""
        if not self.flatten_state_dict or _validate_global_plan is None:
            return super()._create_global_plan(all_plans)  # type: ignore[no-any-return]
        return global_save_plan(self._dedup_save_plans(all_plans))

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


# -- planning a new save: DCP's plans, built with less work per entry -----------------------------

try:  # DCP's check of a global plan (a private function: torch is pinned, `_validate` below)
    from torch.distributed.checkpoint.default_planner import _validate_global_plan
except ImportError:  # pragma: no cover - another torch: DCP's own global planning
    _validate_global_plan = None  # type: ignore[assignment]

_SAME_FIELDS = list(MetadataIndex("").__dict__.items()) == [("fqn", ""), ("index", None)] and list(
    WriteItem(index=None, type=WriteItemType.BYTE_IO).__dict__.items()  # type: ignore[arg-type]
) == [
    ("index", None),
    ("type", WriteItemType.BYTE_IO),
    ("bytes_io_data", None),
    ("tensor_data", None),
]
"""Whether DCP's constructors set exactly the attributes `local_save_plan` sets itself."""

_BYTES = BytesStorageMetadata()
"""The one metadata object of every byte item (it has no fields; DCP makes one per item)."""


def local_save_plan(state: dict[str, Any], mappings: dict[str, Any]) -> SavePlan:
    """DCP's local save plan (`create_default_local_save_plan`, planner data `mappings`) for
    the flat `state`, the same items in the same order, made with less work per entry: a
    plain tensor's item is built here (its index hint already the one the global plan gives
    a tensor of one chunk, 0), its properties and zero offsets shared with every tensor of the
    same kind; a plain value's item directly. Anything else (DTensors, ShardedTensors, tensor
    subclasses) through DCP's own `_create_write_items`. Called on: every rank, when its
    plan is not reused."""
    items: list[WriteItem] = []
    append = items.append
    props: dict[tuple[Any, ...], TensorProperties] = {}
    zeros: dict[int, torch.Size] = {}
    tensor_item = WriteItemType.TENSOR
    contiguous = torch.contiguous_format
    # A byte item and its index get the attributes their constructors set, in the same order,
    # set directly (`_SAME_FIELDS`): without a frozen dataclass's `__init__` (a call per field)
    # for each of the tens of thousands of values, and without an attribute dict per object
    # (one more object for the collector to walk, for as long as the plan is kept).
    new, put = object.__new__, object.__setattr__
    byte_io = WriteItemType.BYTE_IO
    direct = _SAME_FIELDS
    for fqn, obj in state.items():
        kind = type(obj)
        if kind in _LEAVES:
            if direct:
                index = new(MetadataIndex)
                put(index, "fqn", fqn)
                put(index, "index", None)
                item = new(WriteItem)
                put(item, "index", index)
                put(item, "type", byte_io)
                put(item, "bytes_io_data", None)
                put(item, "tensor_data", None)
            else:  # pragma: no cover - another torch
                item = WriteItem(index=MetadataIndex(fqn), type=byte_io)
            append(item)
        elif kind in _PLAIN:
            size = obj.size()
            offsets = zeros.get(len(size))
            if offsets is None:
                offsets = zeros[len(size)] = torch.Size([0] * len(size))
            key = (obj.dtype, obj.layout, obj.requires_grad, is_pinned(obj))
            properties = props.get(key)
            if properties is None:
                properties = props[key] = TensorProperties(
                    dtype=key[0],
                    layout=key[1],
                    requires_grad=key[2],
                    memory_format=contiguous,
                    pin_memory=key[3],
                )
            append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets, 0),
                    type=tensor_item,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=size),
                        properties=properties,
                        size=size,
                    ),
                )
            )
        elif kind is DTensor or isinstance(obj, DTensor):
            if obj.device_mesh.get_coordinate() is not None:  # this rank holds a part
                items += _create_write_items(fqn, obj)
        else:
            items += _create_write_items(fqn, obj)
    return SavePlan(items, planner_data=mappings)


def global_save_plan(plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """DCP's global save plan and metadata for the (deduplicated) local `plans`
    (`create_default_global_save_plan`, then the ranks' mappings merged and the plan
    validated, as `DefaultSavePlanner._create_global_plan`), with less work per item: an item
    whose index hint is already right is kept (DCP copies every tensor item twice), every
    byte entry shares one metadata object, and only the tensors stored in more than one
    chunk, or in one chunk that is not the whole tensor, go through DCP's validation (a whole
    tensor in one chunk is always valid). Raises DCP's errors. Called on: the coordinator."""
    md: dict[str, Any] = {}
    new_plans = []
    byte_io, shard = WriteItemType.BYTE_IO, WriteItemType.SHARD
    for plan in plans:
        new_items: list[WriteItem] = []
        append = new_items.append
        for item in plan.items:
            index = item.index
            fqn = index.fqn
            if item.type != shard and fqn in md:
                raise AssertionError("item.index.fqn not in md")
            if item.type == byte_io:
                md[fqn] = _BYTES
                append(item)
                continue
            data = item.tensor_data
            if data is None:
                raise AssertionError("item.tensor_data is not None")
            entry = md.get(fqn)
            if entry is None:
                entry = md[fqn] = TensorStorageMetadata(
                    properties=data.properties, size=data.size, chunks=[]
                )
            hint = len(entry.chunks)
            if index.index != hint:
                item = dataclasses.replace(item, index=dataclasses.replace(index, index=hint))
            append(item)
            if data.chunk is None:
                raise AssertionError(f"Cannot create MD for tensor without bounds. FQN: {fqn}")
            entry.chunks.append(data.chunk)
        new_plans.append(dataclasses.replace(plan, items=new_items))
    merged: dict[str, Any] = {}
    for p in reversed(new_plans):  # as DCP's ChainMap: the first plan's mapping wins
        merged.update(p.planner_data)
    metadata = Metadata(md, planner_data=merged)
    _validate(new_plans, md)
    return new_plans, metadata


def _validate(plans: list[SavePlan], md: dict[str, Any]) -> None:
    """DCP's validation of a global plan, for the entries whose chunks need it."""
    check = {
        fqn: entry for fqn, entry in md.items() if entry is not _BYTES and not _whole_chunk(entry)
    }
    errors = _validate_global_plan(plans, Metadata(check)) if check else []
    if errors:
        summary = "; ".join(errors)
        if len(summary) > 500:
            summary = summary[:500] + "... (truncated)"
        raise ValueError(f"Failed to validate global plan: {summary}")


def _whole_chunk(entry: Any) -> bool:
    """Whether a tensor's metadata holds it in one chunk: the whole tensor, at offset 0."""
    if type(entry) is not TensorStorageMetadata or len(entry.chunks) != 1:
        return False
    chunk = entry.chunks[0]
    return bool(chunk.sizes == entry.size and not any(chunk.offsets))
