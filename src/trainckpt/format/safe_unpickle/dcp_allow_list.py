"""The only globals a DCP `.metadata` pickle may name, and why each is safe to hand to
CPython's C unpickler (`dcp_metadata`). That unpickler calls whatever is on its stack (REDUCE,
NEWOBJ, INST, OBJ, and BUILD's `__setstate__`), and everything on its stack that is not plain
data (numbers, text, bytes, tuples, lists, dicts, sets) came from `find_class`, that is from
`AllowList.find`. So this table is the whole boundary:

- torch's `Size` and `device` and its dtypes are immutable C types and values: calling
  `Size`/`device` builds only a size or a device (they refuse anything else), and BUILD can set
  nothing on them.
- Every other callable is a `Checked` stand-in: it checks its arguments before it builds an
  `OrderedDict`, a set, a pure path, a layout or a memory format, and refuses BUILD (so the
  pickle can change nothing of it, nor any function of torch's).
- DCP's record dataclasses are per-load stand-in subclasses: created empty (NEWOBJ, or
  INST/OBJ without arguments), then filled exactly once by BUILD through their `__setstate__`,
  which checks every declared field's type (and keeps storage paths inside the folder) first.
  `AllowList.finish` refuses a record never filled, and turns each filled one into DCP's own
  class once the pickle has run (so no later BUILD can change a checked record).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections import OrderedDict, deque
from collections.abc import Callable
from itertools import product, repeat
from typing import Any, NamedTuple

import torch

from trainckpt.format.safe_unpickle.refusal import Refused, short

Check = Callable[[Any], bool]
NONE = type(None)


class Checked:
    """A callable the pickle may name: `make(*args)` once `ok(*args)`; refuses BUILD."""

    __slots__ = ("name", "make", "ok")

    def __init__(self, name: str, make: Callable[..., Any], ok: Callable[..., bool]) -> None:
        self.name, self.make, self.ok = name, make, ok

    def __call__(self, *args: Any) -> Any:
        if not self.ok(*args):
            raise Refused(f"{self.name}{short(args)}")
        return self.make(*args)

    def __setstate__(self, state: Any) -> None:
        raise Refused(f"BUILD of {self.name} (setting state on an allowed callable)")


def _items_ok(*args: Any) -> bool:
    """() or one list/tuple (of an OrderedDict's pairs, a set's items)."""
    return not args or (len(args) == 1 and type(args[0]) in (list, tuple))


def _pairs_ok(*args: Any) -> bool:
    return _items_ok(*args) and all(type(p) is tuple and len(p) == 2 for p in (args or [()])[0])


def _parts_ok(*args: Any) -> bool:
    return all(type(a) is str for a in args)


class Field(NamedTuple):
    """What a record's field may hold: a value of exactly one of `kinds` (any value where
    None), and where given, for which `ok(value)` holds too."""

    kinds: tuple[type, ...] | None
    ok: Check | None = None
    why: str = ""


def _all(kind: Any) -> Check:
    """Items (of a list or tuple) all exactly `kind`, checked at C speed."""
    return lambda v: set(map(type, v)) <= {kind}


def _mapping(keys: Any, values: Any) -> Check:
    """A dict whose keys are all exactly `keys` and values all in `values`."""
    return lambda v: set(map(type, v)) <= {keys} and set(map(type, v.values())) <= values


def _inside_folder(path: str) -> bool:
    """A storage record's file: relative, never `..` (DCP's reader joins it to the folder)."""
    return (
        path != ""
        and path[0] not in "/\\"
        and (".." not in path or ".." not in path.replace("\\", "/").split("/"))
    )


def _natural(v: int) -> bool:
    return v >= 0


class AllowList:
    """The globals of one load: `find` is the unpickler's `find_class`; `finish` checks and
    completes what the records' stand-ins built. One per load (it counts that load's records)."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint import filesystem as fs
        from torch.distributed.checkpoint import metadata as md

        self.created = 0  # records created by the pickle
        self.filled: dict[type, list[Any]] = {}  # DCP's class -> its records filled so far
        done: dict[type, type] = {}  # DCP's class -> the type of its filled records
        encodings = {e.value: e for e in md._MEM_FORMAT_ENCODING}
        layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
        paths = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)
        size = torch.Size

        def record(cls: type, **fields: Field) -> type:
            """The stand-in for `cls` (whose fields are `fields`), and the type of its filled
            records."""
            done[cls] = type(f"Filled{cls.__name__}", (cls,), {"__slots__": (), **_FILLED})
            return self._stand_in(cls, fields, done[cls])

        chunk = record(md.ChunkStorageMetadata, offsets=Field((size,)), sizes=Field((size,)))
        props = record(
            md.TensorProperties,
            dtype=Field((torch.dtype,)),
            layout=Field((torch.layout,)),
            requires_grad=Field((bool,)),
            memory_format=Field((md._MEM_FORMAT_ENCODING,)),
            pin_memory=Field((bool,)),
        )
        tensor = record(
            md.TensorStorageMetadata,
            properties=Field((done[md.TensorProperties],)),
            size=Field((size,)),
            chunks=Field((list,), _all(done[md.ChunkStorageMetadata])),
        )
        blob = record(md.BytesStorageMetadata)
        index = record(
            md.MetadataIndex,
            fqn=Field((str,)),
            offset=Field((NONE, size)),
            index=Field((NONE, int)),
        )
        info = record(
            fs._StorageInfo,
            relative_path=Field((str,), _inside_folder, " (outside the checkpoint folder)"),
            offset=Field((int,), _natural),
            length=Field((int,), _natural),
            transform_descriptors=Field((NONE, list, tuple), lambda v: v is None or _all(str)(v)),
        )
        prefix = record(fs._StoragePrefix, prefix=Field((str,)))
        storage_meta = record(
            md.StorageMeta,
            checkpoint_id=Field((NONE, str, *paths)),
            save_id=Field((NONE, str)),
            load_id=Field((NONE, str)),
            modules=Field((list,), _all(str)),
        )
        entries = _mapping(str, {done[md.TensorStorageMetadata], done[md.BytesStorageMetadata]})
        storage = _mapping(done[md.MetadataIndex], {done[fs._StorageInfo]})
        metadata = record(
            md.Metadata,
            state_dict_metadata=Field((dict,), entries),
            planner_data=Field(None),  # any data: each planner keeps its own
            storage_data=Field((NONE, dict), lambda v: v is None or storage(v)),
            storage_meta=Field((NONE, done[md.StorageMeta])),
            version=Field((NONE, str)),
        )
        self.real = {filled: cls for cls, filled in done.items()}
        dcp, olmo = "torch.distributed.checkpoint.metadata", "olmo_core.distributed.checkpoint"
        self.table: dict[tuple[str, str], Any] = {
            # DCP's records, as DCP and OLMo-core (its own copies of the storage records) write them
            (dcp, "Metadata"): metadata,
            (dcp, "TensorStorageMetadata"): tensor,
            (dcp, "BytesStorageMetadata"): blob,
            (dcp, "ChunkStorageMetadata"): chunk,
            (dcp, "TensorProperties"): props,
            (dcp, "StorageMeta"): storage_meta,
            (dcp, "MetadataIndex"): index,
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): info,
            ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"): prefix,
            (f"{olmo}.filesystem", "_StorageInfo"): info,
            (f"{olmo}.filesystem", "_StoragePrefix"): prefix,
            # immutable C types that build only their own values
            ("torch", "Size"): torch.Size,
            ("torch", "device"): Checked("torch.device", torch.device, _device_ok),
            # checking constructors
            ("torch.serialization", "_get_layout"): Checked(
                "torch layout", layouts.__getitem__, lambda *a: len(a) == 1 and a[0] in layouts
            ),
            (dcp, "_MEM_FORMAT_ENCODING"): Checked(
                "memory format", encodings.__getitem__, lambda *a: len(a) == 1 and a[0] in encodings
            ),
            ("collections", "OrderedDict"): Checked(
                "collections.OrderedDict", OrderedDict, _pairs_ok
            ),
            ("builtins", "set"): Checked("set", set, _items_ok),
            ("builtins", "frozenset"): Checked("frozenset", frozenset, _items_ok),
        }
        for kind in paths:
            self.table[("pathlib", kind.__name__)] = Checked(kind.__name__, kind, _parts_ok)
        for name, value in vars(torch).items():
            if isinstance(value, torch.dtype):  # immutable values
                self.table[("torch", name)] = value

    def find(self, module: str, name: str) -> Any:
        """The global (module, name) if the table has exactly it: no dotted-name walk, no import."""
        try:
            return self.table[(module, name)]
        except (KeyError, TypeError):
            raise Refused(
                f"global {short(f'{module}.{name}')} (not one of DCP's records, "
                "torch sizes/dtypes/layouts/devices or plain containers)"
            ) from None

    def finish(self) -> None:
        """After the pickle ran: refuse a record created but never filled; make every filled
        record an instance of DCP's own class."""
        filled = sum(map(len, self.filled.values()))
        if filled != self.created:
            raise Refused(f"{self.created - filled} DCP record(s) without their state")
        for cls, records in self.filled.items():
            deque(map(object.__setattr__, records, repeat("__class__"), repeat(cls)), maxlen=0)

    def _stand_in(self, cls: type, fields: dict[str, Field], filled_type: type) -> type:
        """A subclass of DCP's record `cls` that pickle may create (counted) and fill once."""
        order = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]
        assert set(order) == set(fields), cls
        names = frozenset(order)
        defaults: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.default is not dataclasses.MISSING:
                defaults[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                defaults[f.name] = f.default_factory
        typed = tuple(n for n in order if fields[n].kinds is not None)
        signatures = frozenset(product(*(fields[n].kinds or () for n in typed)))
        value_checks = tuple((n, f.ok) for n, f in fields.items() if f.ok is not None)
        as_tuple = "__setstate__" in vars(cls)  # TensorProperties: its fields as a tuple
        filled = self.filled.setdefault(cls, [])
        load = self

        def complete(state: dict[str, Any]) -> dict[str, Any]:
            """`state` with the defaults of the fields it lacks; refuses unknown fields."""
            if not names.issuperset(state):
                raise Refused(f"{cls.__qualname__} state {short(state)} is not its fields")
            missing = sorted(names - state.keys() - defaults.keys())
            if missing:
                raise Refused(f"{cls.__qualname__} without its field(s) {missing}")
            made = {n: d() if callable(d) else d for n, d in defaults.items() if n not in state}
            return {**state, **made}

        def check(values: dict[str, Any]) -> None:
            if tuple(map(type, map(values.__getitem__, typed))) in signatures:
                for n, ok in value_checks:
                    if not ok(values[n]):
                        break
                else:
                    return
            if True:
                bad = [
                    n
                    for n, f in fields.items()
                    if (f.kinds is not None and type(values[n]) not in f.kinds)
                    or (f.ok is not None and not f.ok(values[n]))
                ]
                name = bad[0]
                raise Refused(
                    f"{cls.__qualname__}.{name} = {short(values[name])}{fields[name].why}"
                )

        def __new__(kind: type, *args: Any, **kwargs: Any) -> Any:
            if args or kwargs:
                raise Refused(f"{cls.__qualname__} created with arguments {short(args)}")
            load.created += 1
            if not names:  # nothing to fill (pickle writes no BUILD for it): filled now
                inst: Any = object.__new__(filled_type)
                filled.append(inst)
                return inst
            return object.__new__(kind)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            raise Refused(f"{cls.__qualname__} called (DCP's records are only built by BUILD)")

        def __setstate__(self: Any, state: Any) -> None:
            if type(self) is not stand_in:
                raise Refused(f"BUILD of {short(self)} with {cls.__qualname__}'s state")
            if as_tuple:  # TensorProperties: (dtype, layout, ..., memory format encoding, ...)
                if type(state) is not tuple or len(state) != len(order):
                    raise Refused(f"{cls.__qualname__} state {short(state)} is not its fields")
                check(dict(zip(order, state, strict=True)))
                object.__setattr__(self, "__class__", filled_type)
                cls.__setstate__(self, state)  # type: ignore[attr-defined]  # DCP's own
            else:
                if type(state) is tuple and len(state) == 2 and state[1] is None:
                    state = state[0]  # (dict, no slots)
                if type(state) is not dict:
                    raise Refused(f"{cls.__qualname__} state {short(state)} is not its fields")
                if state.keys() != names:
                    state = complete(state)
                check(state)
                object.__setattr__(self, "__class__", filled_type)
                self.__dict__.update(state)
            filled.append(self)

        stand_in = type(
            cls.__name__,
            (cls,),
            {
                "__slots__": (),
                "__new__": __new__,
                "__init__": __init__,
                "__setstate__": __setstate__,
            },
        )
        return stand_in


def _refill(self: Any, state: Any) -> None:
    raise Refused(f"a second BUILD of {type(self).__bases__[0].__qualname__}")


_FILLED = {"__setstate__": _refill}
"""A filled record refuses any further BUILD until `finish` makes it DCP's own class."""


def _device_ok(*args: Any) -> bool:
    return (
        1 <= len(args) <= 2
        and type(args[0]) is str
        and len(args[0]) <= 32
        and (len(args) == 1 or type(args[1]) is int)
    )
