"""The only globals a DCP `.metadata` pickle may name: an exact table of fully qualified names
(no dotted-name walk, no import, no `getattr`). It holds DCP's record dataclasses (built by
NEWOBJ + BUILD, field by declared field), torch dtypes, and checking constructors (the only
things REDUCE may call) for torch sizes, devices, layouts and memory formats, OrderedDict,
set, frozenset and pure paths.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from collections import OrderedDict
from typing import Any, NamedTuple

import torch

from trainckpt.format.safe_unpickle.refusal import Refused, short


class Record:
    """A DCP record class: built only as pickle builds a dataclass (NEWOBJ with no arguments,
    then BUILD with a dict of its declared fields), or by its own `__setstate__` (a tuple)."""

    def __init__(self, cls: type, check: Any = None, validate: Any = None) -> None:
        self.cls = cls
        self.fields = {f.name: f for f in dataclasses.fields(cls)}
        self.names = frozenset(self.fields)
        self.required = frozenset(
            name
            for name, f in self.fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        self.factories = {
            name: f.default_factory
            for name, f in self.fields.items()
            if f.default_factory is not dataclasses.MISSING
        }
        self.check = check  # validates a non-dict state before the class's __setstate__ sees it
        self.validate = validate  # checks a finished record's values

    def build(self, inst: Any, state: Any) -> None:
        if self.check is not None:
            self.check(state)
            inst.__setstate__(state)
            return
        if type(state) is tuple and len(state) == 2 and state[1] is None:
            state = state[0]  # (dict, no slots)
        if type(state) is not dict or not self.names.issuperset(state):
            raise Refused(f"{self.cls.__qualname__} state {short(state)} is not its fields")
        inst.__dict__.update(state)

    def complete(self, inst: Any) -> None:
        """Refuse a record missing a field without default; make the fields that have a
        default factory (the others' defaults are class attributes)."""
        have = inst.__dict__
        if self.check is not None:
            if not have:
                raise Refused(f"{self.cls.__qualname__} without its state")
        elif not self.required.issubset(have):
            missing = sorted(self.required - set(have))
            raise Refused(f"{self.cls.__qualname__} without its field(s) {missing}")
        for name, factory in self.factories.items():
            if name not in have:
                have[name] = factory()
        if self.validate is not None:
            self.validate(inst)


def _size(*args: Any) -> torch.Size:
    if len(args) != 1 or type(args[0]) not in (tuple, list):
        raise Refused(f"torch.Size{short(args)}")
    return torch.Size(args[0])  # refuses anything but integers


def _ordered_dict(*args: Any) -> Any:
    if not args:
        return OrderedDict()
    pairs = args[0]
    if (
        len(args) != 1
        or type(pairs) not in (list, tuple)
        or not all(type(p) is tuple and len(p) == 2 for p in pairs)
    ):
        raise Refused(f"collections.OrderedDict{short(args)}: only () or a list of pairs")
    return OrderedDict(pairs)


def _set_of(kind: type) -> Any:
    def build(*args: Any) -> Any:
        if not args:
            return kind()
        if len(args) != 1 or type(args[0]) not in (list, tuple):
            raise Refused(f"{kind.__name__}{short(args)}: only () or a list")
        return kind(args[0])

    return build


def _device(*args: Any) -> torch.device:
    if not (
        1 <= len(args) <= 2
        and type(args[0]) is str
        and len(args[0]) <= 32
        and (len(args) == 1 or type(args[1]) is int)
    ):
        raise Refused(f"torch.device{short(args)}")
    return torch.device(*args)


def _path_of(kind: type) -> Any:
    def build(*args: Any) -> Any:
        if not all(type(a) is str for a in args):
            raise Refused(f"{kind.__name__}{short(args)}: only str parts")
        return kind(*args)

    return build


def check_storage_info(info: Any) -> None:
    """Where a DCP item lies: a file inside the checkpoint folder, a non-negative range."""
    path = info.relative_path
    if (
        type(path) is not str
        or not path
        or path.startswith(("/", "\\"))
        or ".." in path.replace("\\", "/").split("/")
        or type(info.offset) is not int
        or type(info.length) is not int
        or info.offset < 0
        or info.length < 0
    ):
        raise Refused(f"storage record {short(vars(info))} (outside the checkpoint folder?)")


class DcpGlobals(NamedTuple):
    """The table, as the interpreter uses it."""

    by_name: dict[tuple[str, str], Any]
    """Every admitted global by exact (module, qualified name)."""
    records: dict[int, Record]
    """DCP's record classes, by `id` of the class."""
    constructors: frozenset[int]
    """`id`s of the checking constructors: the only things REDUCE calls."""


@functools.cache
def dcp_globals() -> DcpGlobals:
    """The table, built on first use (importing DCP's modules is not free)."""
    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as md

    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    encodings = {e.value: e for e in md._MEM_FORMAT_ENCODING}

    def layout(*args: Any) -> torch.layout:
        if len(args) != 1 or type(args[0]) is not str or args[0] not in layouts:
            raise Refused(f"torch layout {short(args)}")
        return layouts[args[0]]

    def mem_format(*args: Any) -> Any:
        if len(args) != 1 or type(args[0]) is not int or args[0] not in encodings:
            raise Refused(f"memory format encoding {short(args)}")
        return encodings[args[0]]

    def check_properties(state: Any) -> None:
        ok = (
            type(state) is tuple
            and len(state) == 5
            and isinstance(state[0], torch.dtype)
            and isinstance(state[1], torch.layout)
            and type(state[2]) is bool
            and state[3] in encodings.values()
            and type(state[4]) is bool
        )
        if not ok:
            raise Refused(f"TensorProperties state {short(state)}")

    records: dict[type, Record] = {
        cls: Record(cls)
        for cls in (
            md.Metadata,
            md.TensorStorageMetadata,
            md.BytesStorageMetadata,
            md.ChunkStorageMetadata,
            md.StorageMeta,
            md.MetadataIndex,
            fs._StoragePrefix,
        )
    }
    records[md.TensorProperties] = Record(md.TensorProperties, check=check_properties)
    records[fs._StorageInfo] = Record(fs._StorageInfo, validate=check_storage_info)
    constructors: dict[tuple[str, str], Any] = {
        ("torch", "Size"): _size,
        ("torch", "device"): _device,
        ("torch.serialization", "_get_layout"): layout,
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): mem_format,
        ("collections", "OrderedDict"): _ordered_dict,
        ("builtins", "set"): _set_of(set),
        ("builtins", "frozenset"): _set_of(frozenset),
        ("pathlib", "PosixPath"): _path_of(pathlib.PosixPath),
        ("pathlib", "PurePosixPath"): _path_of(pathlib.PurePosixPath),
        ("pathlib", "PureWindowsPath"): _path_of(pathlib.PureWindowsPath),
    }
    table: dict[tuple[str, str], Any] = {(cls.__module__, cls.__qualname__): cls for cls in records}
    # OLMo-core writes DCP metadata with its own copies of DCP's two storage records.
    table[("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo")] = fs._StorageInfo
    table[("olmo_core.distributed.checkpoint.filesystem", "_StoragePrefix")] = fs._StoragePrefix
    table.update(constructors)
    for name, value in vars(torch).items():
        if isinstance(value, torch.dtype):
            table[("torch", name)] = value
    return DcpGlobals(
        by_name=table,
        records={id(cls): rec for cls, rec in records.items()},
        constructors=frozenset(id(f) for f in constructors.values()),
    )
