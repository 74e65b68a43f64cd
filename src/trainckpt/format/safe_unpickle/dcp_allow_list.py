"""The only globals a DCP `.metadata` pickle may name, and why each is safe to hand to
CPython's C unpickler (`dcp_metadata`). That unpickler calls whatever is on its stack (REDUCE,
NEWOBJ, INST, OBJ, and BUILD's `__setstate__`), and everything on its stack that is not plain
data (numbers, text, bytes, tuples, lists, dicts, sets) came from `find_class`, that is from
`AllowList.find`. So this table is the whole boundary:

- torch's `Size` and its dtypes are immutable C types and values: calling `Size` builds only a
  size of integers, and BUILD can set nothing on them.
- Every other callable is a `Checked` stand-in: it checks its arguments before it builds a
  device, an `OrderedDict`, a set, a pure path, a layout or a memory format, and refuses BUILD
  (so the pickle can change nothing of it, nor any function of torch's).
- Each of DCP's record dataclasses is named by a `RecordMaker`: NEWOBJ on it makes a bare
  record of DCP's own class (`object.__new__`, no code of DCP's or ours), BUILD fills its
  fields (only `TensorProperties` keeps DCP's `__setstate__`, which assigns its five fields),
  and calling it or setting anything on it is refused, so DCP's classes stay as DCP defined
  them. After the pickle ran, `AllowList.check` takes only a `Metadata` and checks every record
  where DCP's `Metadata` declares one, field by field and column by column (exact types with
  C-speed set operations, storage paths inside the folder), so a record is checked as it
  finally stands, however often the pickle rebuilt it. The one field of free data,
  `planner_data`, must hold plain data only, so no record is left unchecked.

The steps that run once per record (a maker's `__new__`, parting the entries by class, the
column check, the walk of `planner_data`) run in C where the install built `fast_records.c`:
it only ever answers "as DCP writes it" or "plain data"; anything else goes to the Python
steps here, which decide and name the refusal, and which run alone where the C steps were not
built.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pathlib
from collections import OrderedDict
from collections.abc import Callable, Set
from itertools import chain, compress, repeat
from operator import attrgetter, is_, is_not, itemgetter, methodcaller, not_, or_
from types import MethodType, ModuleType
from typing import Any, NamedTuple

import torch

from trainckpt.format.safe_unpickle.refusal import Refused, short

_built: ModuleType | None
try:  # the per-record steps in C (fast_records.c), where the install could build them
    from trainckpt.format.safe_unpickle import fast_records as _built
except ImportError:  # an install without a C compiler: the same steps in Python
    _built = None
compiled = _built  # what `allow_list()` uses (tests set None to run the Python steps)
log = logging.getLogger(__name__)


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
    """What a record's field may hold: a value of exactly one of `kinds` (any where None);
    where given, `ok(column)` must hold too for the column of that field over all records
    (values of those kinds)."""

    kinds: tuple[Any, ...] | None
    ok: Callable[[list[Any]], bool] | None = None
    why: str = ""


def _items(kinds: Any) -> Callable[[list[Any]], bool]:
    """Each value that is a list or tuple holds only items of exactly `kinds`."""
    return lambda col: (
        set(map(type, chain.from_iterable(filter(None, col))))  # None or a list or tuple
        <= set(kinds)
    )


def _inside_folder(paths: list[str]) -> bool:
    """Storage records' files: relative, never `..` (DCP's reader joins them to the folder)."""
    if not paths:
        return True
    unique = set(paths)  # a file's name is one string, shared by its records
    if min(map(len, unique)) == 0 or any(map(str.startswith, unique, repeat(("/", "\\")))):
        return False
    dotted = filter(methodcaller("__contains__", ".."), unique)  # rare: checked exactly
    return not any(".." in p.replace("\\", "/").split("/") for p in dotted)


def _natural(col: list[int]) -> bool:
    return not col or min(col) >= 0


class AllowList:
    """The globals a `.metadata` may name (`find`, the unpickler's `find_class`) and the check
    of what its pickle built (`check`). Holds nothing of a load: one serves every load, on
    any thread (`allow_list`). With `fast` (the module `fast_records`), records are made and
    checked in C where they are as DCP writes them; the Python check still decides and names
    every refusal, and without `fast` does all of it."""

    def __init__(self, fast: ModuleType | None = None) -> None:
        from torch.distributed.checkpoint import filesystem as fs
        from torch.distributed.checkpoint import metadata as md

        self.md, self.fs = md, fs
        encodings = {e.value: e for e in md._MEM_FORMAT_ENCODING}
        layouts, dtypes = _torch_values()
        paths = (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.PureWindowsPath)
        size, none = torch.Size, type(None)
        self.fields: dict[type, dict[str, Field]] = {
            md.ChunkStorageMetadata: {"offsets": Field((size,)), "sizes": Field((size,))},
            md.TensorProperties: {
                "dtype": Field((torch.dtype,)),
                "layout": Field((torch.layout,)),
                "requires_grad": Field((bool,)),
                "memory_format": Field((torch.memory_format,)),
                "pin_memory": Field((bool,)),
            },
            md.TensorStorageMetadata: {
                "properties": Field(None),  # checked as TensorProperties records
                "size": Field((size,)),
                "chunks": Field((list,)),  # checked as ChunkStorageMetadata records
            },
            md.BytesStorageMetadata: {},
            md.MetadataIndex: {
                "fqn": Field((str,)),
                "offset": Field((none, size)),
                "index": Field((none, int)),
            },
            fs._StorageInfo: {
                "relative_path": Field((str,), _inside_folder, " (outside the checkpoint folder)"),
                "offset": Field((int,), _natural),
                "length": Field((int,), _natural),
                "transform_descriptors": Field((none, list, tuple), _items((str,))),
            },
            md.StorageMeta: {
                "checkpoint_id": Field((none, str, *paths)),
                "save_id": Field((none, str)),
                "load_id": Field((none, str)),
                "modules": Field((list,), _items((str,))),
            },
            md.Metadata: {
                "state_dict_metadata": Field((dict,)),  # checked as records
                "planner_data": Field(None),  # any data: each planner keeps its own
                "storage_data": Field((none, dict)),  # checked as records
                "storage_meta": Field(None),  # checked as a StorageMeta record
                "version": Field((none, str)),
            },
        }
        self.columns = {cls: _columns(cls, fields) for cls, fields in self.fields.items()}
        self.fast = fast
        self.fast_columns = {cls: _fast_columns(cols) for cls, cols in self.columns.items()}
        st = {cls: RecordMaker.of(cls, fast) for cls in self.fields}  # what the table names
        metadata, tensor = st[md.Metadata], st[md.TensorStorageMetadata]
        chunk, props, storage_meta = (
            st[md.ChunkStorageMetadata],
            st[md.TensorProperties],
            st[md.StorageMeta],
        )
        index, info, blob = st[md.MetadataIndex], st[fs._StorageInfo], st[md.BytesStorageMetadata]
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
            (f"{olmo}.filesystem", "_StorageInfo"): info,
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
        self.table.update((("torch", name), dtype) for name, dtype in dtypes.items())

    def find(self, module: str, name: str) -> Any:
        """The global (module, name) if the table has exactly it: no dotted-name walk, no import."""
        try:
            return self.table[(module, name)]
        except (KeyError, TypeError):
            raise Refused(
                f"global {short(f'{module}.{name}')} (not one of DCP's records, "
                "torch sizes/dtypes/layouts/devices or plain containers)"
            ) from None

    def check(self, result: Any, budget: int) -> None:
        """After the pickle ran: `result` must be DCP's `Metadata` (else `NotMetadata`, or a
        refusal if it holds more than plain data); check each of its records where DCP
        declares one, and that its `planner_data` holds plain data only (at most `budget`
        values: the pickle's size, which a tree of plain values never exceeds)."""
        if type(result) is not self.md.Metadata:
            problem = _plain_data_problem(result, budget)
            if problem is not None:
                raise Refused(f"{problem} outside DCP's Metadata")
            raise NotMetadata(type(result).__qualname__)  # plain data: damaged, not crafted
        self._check_metadata(result)
        problem = self._plain_data_problem(result.planner_data, budget)
        if problem is not None:
            raise Refused(f"Metadata.planner_data holding {problem} (only plain data is read)")

    def _plain_data_problem(self, value: Any, budget: int) -> str | None:
        """`_plain_data_problem`, answered in C where `value` is plain data."""
        if self.fast is not None and self.fast.plain(value, budget, _PLAIN, _NESTED):
            return None
        return _plain_data_problem(value, budget)

    def _check_metadata(self, metadata: Any) -> None:
        """Check the records of `metadata` where DCP's `Metadata` declares them."""
        md, fs = self.md, self.fs
        self._check(md.Metadata, [metadata])
        entries = metadata.state_dict_metadata
        self._types("Metadata.state_dict_metadata keys", entries, {str})
        tensors, blobs = self._by_class(
            "Metadata.state_dict_metadata values",
            list(entries.values()),
            (md.TensorStorageMetadata, md.BytesStorageMetadata),
        )
        if blobs:
            self._check(md.BytesStorageMetadata, blobs)
        properties, chunk_lists = self._check(
            md.TensorStorageMetadata, tensors, ("properties", "chunks")
        )
        self._check(md.TensorProperties, properties)
        self._check(md.ChunkStorageMetadata, list(chain.from_iterable(chunk_lists)))
        if metadata.storage_data is not None:
            self._check(md.MetadataIndex, list(metadata.storage_data))
            self._check(fs._StorageInfo, list(metadata.storage_data.values()))
        if metadata.storage_meta is not None:
            self._check(md.StorageMeta, [metadata.storage_meta])

    def _by_class(self, what: str, values: list[Any], classes: tuple[type, type]) -> list[Any]:
        """`values` parted by their exact class: a list per class of `classes` (refused if a
        value is of neither; `what` names them)."""
        if self.fast is not None:
            parts = self.fast.by_class(values, classes)
            if parts is not None:
                return list(parts)
        self._types(what, values, set(classes))
        is_first = list(map(is_, map(type, values), repeat(classes[0])))
        return [list(compress(values, is_first)), list(compress(values, map(not_, is_first)))]

    def _types(self, what: str, values: Any, kinds: Set[Any]) -> None:
        found = set(map(type, values))
        if not found <= kinds:
            raise Refused(f"{what} of type {short(sorted(t.__qualname__ for t in found - kinds))}")

    def _check(self, cls: type, records: list[Any], keep: tuple[str, ...] = ()) -> list[Any]:
        """Check the records `records` of DCP's class `cls`, column by column, and return the
        columns of the (required) fields `keep`: the records they hold, checked next. A field
        an older writer did not have (or DCP's `_StorageInfo` left out, being None) reads as
        its default, as in DCP."""
        if self.fast is not None:
            names, kinds, optional, checked = self.fast_columns[cls]
            wanted = tuple(map(keep.__contains__, names))
            kept = self.fast.check_records(
                records, cls, names, kinds, optional, tuple(map(or_, checked, wanted))
            )
            if kept is not None:  # as DCP writes them: each field's own check remains
                for c, column in zip(self.columns[cls], kept, strict=True):
                    if c.ok is not None and not c.ok(column):
                        raise Refused(f"{cls.__qualname__}.{c.name}: a value{c.why}")
                return [column for column, w in zip(kept, wanted, strict=True) if w]
        self._check_python(cls, records)
        return [list(map(attrgetter(name), records)) for name in keep]

    def _check_python(self, cls: type, records: list[Any]) -> None:
        """`_check` without the C steps (and where they found records unlike DCP's)."""
        if set(map(type, records)) - {cls}:
            self._types(f"a {cls.__qualname__} record", records, {cls})
        dicts: list[dict[Any, Any]] = list(map(vars, records))  # type: ignore[arg-type]
        if not self._check_alike(cls, dicts):
            self._check_each(cls, dicts)

    def _check_alike(self, cls: type, dicts: list[dict[Any, Any]]) -> bool:
        """True if the records (their `dicts`) are good, as DCP writes them: fields of `cls`
        only, each of its kinds, and fields left out only where their plain default is good
        (DCP leaves a `MetadataIndex`'s offset out of the records of non-tensors). False where
        that is not so (`_check_each` then decides, and names what is wrong). The fewest steps
        per column, for the many small `.metadata` files too."""
        held = 0  # values of `cls`'s fields, over all records
        left_out = []  # fields some record lacks: counted only if the keys do not add up
        for c in self.columns[cls]:
            try:
                column = list(map(c.get, dicts))
            except KeyError:
                if not c.default_fits:
                    return False
                left_out.append(c)
                continue
            held += len(column)
            if not self._column_ok(cls, c, column):
                return False
        keys = sum(map(len, dicts))
        for c in left_out if keys != held else ():  # held by some records: checked there
            column = c.read(dicts)
            column = list(compress(column, map(is_not, column, repeat(_ABSENT))))  # runs no code
            held += len(column)
            if not self._column_ok(cls, c, column):
                return False
        # A record's keys are distinct: they are all fields of `cls` iff the counts agree.
        return keys == held

    def _column_ok(self, cls: type, c: _Column, column: list[Any]) -> bool:
        """Whether the values `column` of field `c` are of its kinds; raises where a value
        fails the field's own check."""
        if c.kinds is not None and not c.kinds.issuperset(map(type, column)):
            return False
        if c.ok is not None and not c.ok(column):
            raise Refused(f"{cls.__qualname__}.{c.name}: a value{c.why}")
        return True

    def _check_each(self, cls: type, dicts: list[dict[Any, Any]]) -> None:
        """`_check` where records differ: fields left out of some records only, a default
        factory's value to store, or a refusal to name."""
        keys, held = sum(map(len, dicts)), 0  # all the records' keys; those of `cls`'s fields
        for c in self.columns[cls]:
            try:
                column = c.read(dicts)
            except KeyError:  # a field without a plain default (a factory's value is stored)
                if c.factory is None:
                    raise Refused(f"{cls.__qualname__} without its field {c.name!r}") from None
                missing = [d for d in dicts if c.name not in d]
                for d in missing:
                    d[c.name] = c.factory()
                held -= len(missing)
                column = c.read(dicts)
            absent = sum(map(is_, column, repeat(_ABSENT)))  # by identity: runs no code
            held += len(column) - absent
            if absent:  # a field left out: read as its plain default
                column = [c.default if v is _ABSENT else v for v in column]
            if not self._column_ok(cls, c, column):
                assert c.kinds is not None  # only kinds make `_column_ok` false
                self._types(f"{cls.__qualname__}.{c.name}", column, c.kinds)  # raises
        if keys != held:  # the records' other keys are fields `cls` lacks
            unknown = set(chain.from_iterable(dicts)) - self.fields[cls].keys()
            raise Refused(f"{cls.__qualname__} with field(s) {short(sorted(map(str, unknown)))}")


def allow_list() -> AllowList:
    """The allow-list every load uses: with the C steps where built (`compiled`). Made at the
    first load (it imports DCP)."""
    return _allow_list(compiled)


@functools.cache
def _allow_list(fast: ModuleType | None) -> AllowList:
    if fast is None:
        log.warning(
            "DCP .metadata files are read with the Python steps alone (about five times the "
            "time of the C steps for large files): trainckpt was installed without a C "
            "compiler, so fast_records.c was not built; install gcc and Python's headers and "
            "reinstall trainckpt"
        )
    return AllowList(fast)


class NotMetadata(Exception):  # noqa: N818 (a result, not an error of ours)
    """The pickle built something other than DCP's `Metadata` (named by the argument)."""


class RecordMaker(type):
    """What the table gives for one of DCP's record classes. NEWOBJ on it (and INST or OBJ
    without arguments) makes a bare record of DCP's own class, by `object.__new__` alone;
    calling it, or setting or deleting anything on it (as BUILD on a class would), is
    refused."""

    @classmethod
    def of(cls, record: type, fast: ModuleType | None) -> RecordMaker:
        """The maker of `record`: with `fast`, its `__new__` is the C one of `fast_records`
        (NEWOBJ on it costs what it costs on DCP's class), else `object.__new__` bound to
        `record` (called through Python, a few times slower)."""
        if fast is None:
            new = MethodType(object.__new__, record)  # new(maker, *args): object.__new__(record)
            return cls(record.__name__, (), {"__slots__": (), "__new__": new})
        maker = cls(record.__name__, (fast.RecordBase,), {"__slots__": ()})
        fast.bind(maker, record)
        return maker

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        raise Refused(f"{cls.__name__} called (DCP's records are built by NEWOBJ and BUILD)")

    def __setattr__(cls, name: str, value: Any) -> None:
        raise Refused(f"BUILD of {cls.__name__} (setting {short(name)} on a record class)")

    def __delattr__(cls, name: str) -> None:
        raise Refused(f"deleting {short(name)} of {cls.__name__}")


_PLAIN = frozenset(
    {str, int, float, bool, type(None), bytes, torch.Size, torch.dtype, torch.device}
    | {torch.layout, torch.memory_format, pathlib.PosixPath, pathlib.PurePosixPath}
    | {pathlib.PureWindowsPath}
)
_NESTED = frozenset({dict, OrderedDict, list, tuple, set, frozenset})


def _plain_data_problem(value: Any, budget: int) -> str | None:
    """None if `value` is plain data (values of `_PLAIN`, nested in `_NESTED` containers), at
    most `budget` values in all; else what is wrong. Breadth first, at C speed per level."""
    level, seen = [value], 1
    while level:
        kinds = set(map(type, level))
        odd = kinds - _PLAIN - _NESTED
        if odd:
            return f"a value of type {short(sorted(t.__qualname__ for t in odd))}"
        nested = [
            list(compress(level, map(is_, map(type, level), repeat(k)))) for k in kinds & _NESTED
        ]
        seen += sum(
            sum(map(len, of_kind)) * (1 + isinstance(of_kind[0], dict)) for of_kind in nested
        )
        if seen > budget:  # counted before the next level is made
            return "more values than its bytes hold (containers shared or nested in themselves)"
        level = []
        for of_kind in nested:
            if isinstance(of_kind[0], dict):  # a dict or an OrderedDict: keys and values
                level += chain.from_iterable(map(dict.keys, of_kind))
                level += chain.from_iterable(map(dict.values, of_kind))
            else:
                level += chain.from_iterable(of_kind)
    return None


_ABSENT = object()


@functools.cache
def _torch_values() -> tuple[dict[str, torch.layout], dict[str, torch.dtype]]:
    """torch's layouts by their text and its dtypes by name (immutable values)."""
    values = vars(torch)
    layouts = {str(v): v for v in values.values() if isinstance(v, torch.layout)}
    return layouts, {name: v for name, v in values.items() if isinstance(v, torch.dtype)}


class _Column(NamedTuple):
    """How `_check` reads and checks one field of a record class (`Field`, made ready)."""

    name: str
    get: Callable[[dict[Any, Any]], Any]  # a record's value (KeyError where it lacks the field)
    read: Callable[[list[dict[Any, Any]]], list[Any]]  # the records' values (`_ABSENT`: default)
    default: Any  # a plain default (read where a record lacks the field), else `_ABSENT`
    factory: Callable[[], Any] | None  # a default factory: its value is stored in the record
    kinds: frozenset[Any] | None
    ok: Callable[[list[Any]], bool] | None
    why: str
    default_fits: bool  # a plain default that passes `kinds` and `ok`: a record may leave it out


def _columns(cls: type, fields: dict[str, Field]) -> tuple[_Column, ...]:
    declared = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    out = []
    for name, field in fields.items():
        known = declared.get(name)  # a field this torch's DCP lacks is read as required
        default = dataclasses.MISSING if known is None else known.default
        factory = dataclasses.MISSING if known is None else known.default_factory
        plain = default is not dataclasses.MISSING
        kinds = None if field.kinds is None else frozenset(field.kinds)
        fits = plain and (kinds is None or type(default) in kinds)
        out.append(
            _Column(
                name,
                itemgetter(name),
                _read(name, plain),
                default if plain else _ABSENT,
                None if factory is dataclasses.MISSING else factory,
                kinds,
                field.ok,
                field.why,
                fits and (field.ok is None or field.ok([default])),
            )
        )
    return tuple(out)


def _fast_columns(columns: tuple[_Column, ...]) -> tuple[tuple[Any, ...], ...]:
    """The fields as `fast_records.check_records` takes them: names, kinds, whether a record
    may leave each out (its plain default is good), whether to return its values (for `ok`)."""
    return (
        tuple(c.name for c in columns),
        tuple(c.kinds for c in columns),
        tuple(c.default_fits for c in columns),
        tuple(c.ok is not None for c in columns),
    )


def _read(name: str, plain: bool) -> Callable[[list[dict[Any, Any]]], list[Any]]:
    """The column of field `name` of the records whose dicts are given: `_ABSENT` where a
    record lacks a field with a `plain` default; a missing field raises KeyError otherwise.
    (`dict.get` mapped over the dicts: a quarter of the time of a `methodcaller` per record.)"""
    if plain:
        return lambda dicts: list(map(dict.get, dicts, repeat(name), repeat(_ABSENT)))
    get = itemgetter(name)
    return lambda dicts: list(map(get, dicts))


def _device_ok(*args: Any) -> bool:
    return (
        1 <= len(args) <= 2
        and type(args[0]) is str
        and len(args[0]) <= 32
        and (len(args) == 1 or type(args[1]) is int)
    )
