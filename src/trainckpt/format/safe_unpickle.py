"""Loaders that can only build data: the one module that decides what a checkpoint's pickles may
name. A security boundary: nothing read from a checkpoint is ever called, imported or executed.

- Trainer state (`torch.save` files): `load_torch_plain`, PyTorch's `weights_only` unpickler (its
  own list of tensor and container globals) plus, scoped to the call, exactly numpy's
  reconstruction globals, bound to stand-ins that build only plain numeric/bool arrays, scalars
  and dtypes.
- Pickled bytes that a trainer keeps inside its state (torchtitan's data loader stores its
  position as `pickle.dumps` bytes and its `load_state_dict` calls `pickle.loads` on them; DCP
  hands them over as plain data): `check_plain_pickles` vets them before the trainer's own
  `pickle.loads`, with `NoGlobalsUnpickler`, which admits no global at all, so bytes that pass
  cannot run code when the trainer unpickles them and bytes that do not are refused first.
- DCP's `.metadata` (a plain protocol-2..5 pickle, which PyTorch's unpickler cannot read):
  `load_dcp_metadata`, an interpreter of the data opcodes only, whose globals are an exact table
  of fully qualified names (no dotted-name walk, no import, no `getattr`), whose REDUCE calls only
  the table's checking constructors and whose NEWOBJ/BUILD build only DCP's record dataclasses.

Every refusal is an `UnsafeCheckpointError`; a damaged file (a torn zip, a truncated pickle) is a
`CorruptCheckpointError`. Both name the file.
"""

from __future__ import annotations

import gc
import io
import math
import pickle
import struct
import threading
import zipfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from trainckpt.errors import CorruptCheckpointError, UnsafeCheckpointError


class _Refused(pickle.UnpicklingError):
    """A pickle asked for something the allow-list does not admit (raised while unpickling, so
    PyTorch's loader passes it through as an `UnpicklingError`)."""


# -- numpy values in torch.save files --------------------------------------------------------------

# numpy's pickled dtype codes of the plain dtypes: bool, signed/unsigned ints, float16/32/64,
# complex64/128. Not admitted: object, strings, void/structured, datetimes, longdouble.
_PLAIN_DTYPE_CODES = frozenset(
    {"b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16"}
)
_PLAIN_DTYPE_STATE_TAIL = (None, None, None, -1, -1, 0)


def _short(value: Any) -> str:
    """repr of a value from a checkpoint, cut short (an attacker chooses its size)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an integer too long to print, or too deep
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= 80 else text[:77] + "..."


def _numpy() -> Any:
    """numpy, imported only when a checkpoint names it (numpy is optional)."""
    try:
        import numpy
    except ImportError as e:
        raise _Refused("the file holds numpy values but numpy is not installed") from e
    return numpy


def _dtype_code(dtype: Any) -> str | None:
    """numpy's pickled code of `dtype` (e.g. "u4") when it is a plain dtype, else None."""
    if dtype.fields is not None or dtype.subdtype is not None or dtype.metadata is not None:
        return None
    code = f"{dtype.kind}{dtype.itemsize}"
    return code if code in _PLAIN_DTYPE_CODES else None


def numpy_value_problem(value: Any) -> str | None:
    """None if `value` (whose type lives in numpy) is a plain numpy value trainer state may hold
    (an `ndarray` of a plain dtype, a numpy scalar or dtype); else what is wrong with it."""
    np = _numpy()
    if type(value) is np.ndarray:
        if _dtype_code(value.dtype) is None:
            return f"a numpy.ndarray of dtype {value.dtype} (only numeric and bool dtypes load)"
        return None
    if isinstance(value, np.generic):
        if _dtype_code(value.dtype) is None:
            return f"a numpy scalar of dtype {value.dtype} (only numeric and bool dtypes load)"
        return None
    if isinstance(value, np.dtype):
        return None if _dtype_code(value) is not None else f"numpy dtype {value}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


_our_load = threading.local()
"""`active` is True in the thread running `load_torch_plain`'s `torch.load`, and only there."""


def _only_in_our_loads(name: str) -> None:
    """Refuse a stand-in to any `torch.load` but ours. PyTorch's allow-list is one process-wide
    set, so while we load, a `weights_only` load the user runs on another thread could reach
    our stand-ins by name; it then fails as it would without trainckpt, instead of building
    them. Called by every stand-in first."""
    if not getattr(_our_load, "active", False):
        raise pickle.UnpicklingError(
            f"Unsupported global: GLOBAL {name} was not an allowed global by default "
            "(trainckpt allows it in its own loads only)"
        )


class _NumpyDType:
    """Stands in for `numpy.dtype` while unpickling: built only from a plain dtype code, and
    given only the state numpy writes for one (a byte order)."""

    code: str
    value: Any = None

    def __new__(cls, code: Any = None, align: Any = False, copy: Any = True, *rest: Any) -> Any:
        _only_in_our_loads("numpy.dtype")
        if rest or type(code) is not str or code not in _PLAIN_DTYPE_CODES or align:
            raise _Refused(f"numpy.dtype{_short((code, align, copy, *rest))} is not a plain dtype")
        self = object.__new__(cls)
        self.code = code
        return self

    def __setstate__(self, state: Any) -> None:
        if (
            self.value is not None
            or type(state) is not tuple
            or len(state) != 8
            or state[0] != 3
            or state[1] not in ("<", ">", "|", "=")
            or state[2:] != _PLAIN_DTYPE_STATE_TAIL
        ):
            raise _Refused(f"numpy dtype state {_short(state)} is not that of a plain dtype")
        dtype = _numpy().dtype(self.code)
        self.value = dtype.newbyteorder(state[1]) if state[1] in "<>" else dtype

    def __hash__(self) -> int:
        raise _Refused("a numpy dtype used as a dict key or set member")

    def built(self) -> Any:
        if self.value is None:
            raise _Refused("a numpy dtype without its state")
        return self.value


class _NumpyArray:
    """Stands in for `numpy.ndarray` while unpickling: its state must be a plain dtype and raw
    bytes of exactly the size of the shape; the real array is a fresh copy of those bytes."""

    value: Any = None

    def __new__(cls, *args: Any) -> Any:
        _only_in_our_loads("numpy.ndarray")
        if args:
            raise _Refused(f"numpy.ndarray{_short(args)}: only an empty array to fill is built")
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if self.value is not None or type(state) is not tuple or len(state) != 5:
            raise _Refused("numpy array state is not (version, shape, dtype, order, bytes)")
        version, shape, dtype, fortran, raw = state
        if (
            version != 1
            or type(shape) is not tuple
            or not all(type(n) is int and n >= 0 for n in shape)
            or type(dtype) is not _NumpyDType
            or type(fortran) is not bool
            or type(raw) is not bytes
        ):
            raise _Refused("numpy array state is not that of a plain array")
        dt = dtype.built()
        count = math.prod(shape)
        if count * dt.itemsize != len(raw):
            raise _Refused(f"numpy array of shape {shape} given {len(raw)} bytes of data")
        flat = _numpy().frombuffer(raw, dtype=dt, count=count)
        self.value = flat.reshape(shape, order="F" if fortran else "C").copy(order="K")

    def __hash__(self) -> int:
        raise _Refused("a numpy array used as a dict key or set member")

    def built(self) -> Any:
        if self.value is None:
            raise _Refused("a numpy array without its data")
        return self.value


def _numpy_reconstruct(subtype: Any, shape: Any, dtype: Any) -> _NumpyArray:
    """`numpy.core.multiarray._reconstruct` as numpy's own pickles call it, and only so."""
    _only_in_our_loads("numpy.core.multiarray._reconstruct")
    if subtype is not _NumpyArray or shape != (0,) or dtype != b"b":
        raise _Refused(f"numpy _reconstruct{_short((subtype, shape, dtype))} is not a plain array")
    return _NumpyArray()


def _numpy_scalar(dtype: Any, raw: Any = None) -> Any:
    """`numpy.core.multiarray.scalar`: a numpy scalar from a plain dtype and its raw bytes."""
    _only_in_our_loads("numpy.core.multiarray.scalar")
    if type(dtype) is not _NumpyDType or type(raw) is not bytes:
        raise _Refused("numpy scalar of something other than a plain dtype and its bytes")
    dt = dtype.built()
    if len(raw) != dt.itemsize:
        raise _Refused(f"numpy scalar of dtype {dt} given {len(raw)} bytes")
    return _numpy().frombuffer(raw, dtype=dt, count=1)[0]


def _empty_bytes(*args: Any) -> bytes:
    """`bytes()`: how protocol 2 pickles `b""` (e.g. the data of an empty array)."""
    _only_in_our_loads("builtins.bytes")
    if args:
        raise _Refused(f"bytes{_short(args)}: only bytes() is built")
    return b""


# What trainer state may name besides PyTorch's own `weights_only` list: (stand-in, exact name).
# numpy 1.x pickles say `numpy.core`, numpy 2 `numpy._core`.
_TORCH_EXTRA_GLOBALS: list[Any] = [
    (_NumpyArray, "numpy.ndarray"),
    (_NumpyDType, "numpy.dtype"),
    (_numpy_reconstruct, "numpy.core.multiarray._reconstruct"),
    (_numpy_reconstruct, "numpy._core.multiarray._reconstruct"),
    (_numpy_scalar, "numpy.core.multiarray.scalar"),
    (_numpy_scalar, "numpy._core.multiarray.scalar"),
    (_empty_bytes, "builtins.bytes"),
]
_STAND_INS = frozenset(id(g) for g, _ in _TORCH_EXTRA_GLOBALS)

# `safe_globals` adds to and removes from one process-wide set: one such load at a time.
_TORCH_LOAD_LOCK = threading.Lock()


def _materialize(obj: Any, seen: set[int]) -> Any:
    """`obj` with the numpy stand-ins replaced by the real values they built, in place in
    lists and dicts (they are fresh from the unpickler); a stand-in left unbuilt, or a bare
    global used as a value, is refused. Real numpy values (from globals the user allowed
    process-wide) must be plain too."""
    t = type(obj)
    if t is _NumpyArray or t is _NumpyDType:
        return obj.built()
    if id(obj) in _STAND_INS:
        raise _Refused(f"{_short(obj)} as a value, not called")
    if t.__module__.startswith("numpy"):
        problem = numpy_value_problem(obj)
        if problem is not None:
            raise _Refused(f"{problem} is not plain data")
        return obj
    if isinstance(obj, (dict, list)):
        if id(obj) in seen:
            return obj
        seen.add(id(obj))
        if isinstance(obj, dict):
            for key, value in list(obj.items()):
                _materialize(key, seen)
                obj[key] = _materialize(value, seen)
        else:
            obj[:] = [_materialize(v, seen) for v in obj]
        return obj
    if t is tuple:
        items = [_materialize(v, seen) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else tuple(items)
    if t is set or t is frozenset:
        for v in obj:
            _materialize(v, seen)
    return obj


def _damaged_container(data: bytes | Path) -> str | None:
    """Why `data` (bytes, or a file) is not an intact `torch.save` file (a zip whose CRCs
    match, or a legacy pickle stream), or None. An intact file that does not load was refused,
    not damaged."""
    if isinstance(data, Path):
        try:
            with open(data, "rb") as f:
                head = f.read(2)
        except OSError as e:
            return f"unreadable ({e})"
    else:
        head = data[:2]
    if head != b"PK":
        return None if head[:1] == b"\x80" else "not a torch.save file"
    try:
        with zipfile.ZipFile(io.BytesIO(data) if isinstance(data, bytes) else data) as z:
            bad = z.testzip()
            if bad is not None:
                return f"zip member {bad} fails its CRC"
            if not any(n.endswith("data.pkl") for n in z.namelist()):
                return "no data.pkl in the zip"
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        return f"torn zip archive ({e})"
    return None


def load_torch_plain(data: bytes | Path, where: str) -> Any:
    """What `torch.save` wrote into `data`, loaded with PyTorch's `weights_only` unpickler plus
    the numpy stand-ins: tensors, plain containers and scalars, numpy arrays/scalars/dtypes of
    plain dtypes. Raises `UnsafeCheckpointError` for anything else and `CorruptCheckpointError`
    for a damaged file (`where`, the quoted file or value, names it); nothing from it is ever
    run. A `Path` is memory-mapped (`mmap=True`): its tensors are views of the file's pages,
    not copies, so loading needs no memory of the file's size; the caller checks the file
    first. Called on: any rank, for its own files."""
    source: Any = str(data) if isinstance(data, Path) else io.BytesIO(data)
    try:
        with _TORCH_LOAD_LOCK, torch.serialization.safe_globals(_TORCH_EXTRA_GLOBALS):
            _our_load.active = True
            try:
                obj = torch.load(
                    source, weights_only=True, map_location="cpu", mmap=isinstance(data, Path)
                )
            finally:
                _our_load.active = False
        return _materialize(obj, set())
    except Exception as e:
        reason = f"{type(e).__name__}: {_first_line(e)}"
        damage = _damaged_container(data)
        if damage is not None:
            raise CorruptCheckpointError(
                f"{where} is damaged ({damage}; {reason}); nothing from it was run. Restore "
                "it from a copy or load an older checkpoint"
            ) from e
        raise UnsafeCheckpointError(
            f"{where} holds more than plain data and is not loaded ({reason}); nothing from "
            "it was run. It was crafted or written by other code: load an older checkpoint or "
            "restore it from a trusted copy"
        ) from e


def _first_line(error: BaseException) -> str:
    """What an error says was refused, without torch's advice to trust the file (its
    `weights_only` errors wrap the reason in a preamble and a pointer to its documentation)."""
    said = str(error)
    if "WeightsUnpickler error:" in said:
        said = said.split("WeightsUnpickler error:", 1)[1]
    lines = [ln.strip() for ln in said.splitlines() if ln.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        lines = [ln for ln in lines[1:] if not ln.startswith(("Check the documentation", "("))]
    return lines[0].split(" Please use ", 1)[0] if lines else ""


# -- pickled bytes inside a state: vetted with no globals at all ----------------------------------

_MAX_PICKLE_BYTES = 256 * 1024 * 1024


class NoGlobalsUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, sets, str, bytes, numbers, bool and None only: every global
    (by GLOBAL, STACK_GLOBAL, INST or an extension code) and every persistent id is refused, so
    no REDUCE, NEWOBJ or BUILD has anything to call."""

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpointError(f"the pickle refers to {_short(f'{module}.{name}')}")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError("the pickle holds persistent ids")


def looks_like_pickle(data: bytes) -> bool:
    """True for bytes that start like a pickle of protocol 2 or later (what `pickle.dumps`
    writes by default)."""
    return len(data) >= 2 and data[0] == 0x80 and 2 <= data[1] <= pickle.HIGHEST_PROTOCOL


def check_plain_pickle(data: bytes, where: str) -> None:
    """Raise `UnsafeCheckpointError` unless `data` unpickles to plain data only (nothing from
    it is run: the check itself looks up no global). `where` names the value for the message."""
    if len(data) > _MAX_PICKLE_BYTES:
        raise UnsafeCheckpointError(
            f"value '{where}': a pickled value of {len(data)} bytes is larger than trainckpt reads "
            f"({_MAX_PICKLE_BYTES}); the checkpoint is damaged or not what it claims"
        )
    try:
        NoGlobalsUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError as e:
        raise UnsafeCheckpointError(
            f"value '{where}' holds pickled bytes that are not plain data ({e}); nothing from it "
            "was loaded or run. Load an older checkpoint, or exclude this state from loading"
        ) from e
    except Exception as e:
        raise UnsafeCheckpointError(
            f"value '{where}' holds pickled bytes that cannot be read as plain data "
            f"({type(e).__name__}: {e}); nothing from it was loaded or run"
        ) from e


def check_plain_pickles(value: Any, where: str) -> None:
    """`check_plain_pickle` on every bytes value inside `value` (nested dicts and lists) that
    looks like a pickle. Called on: each rank, on the state it loaded."""
    if isinstance(value, (bytes, bytearray)):
        if looks_like_pickle(bytes(value)):
            check_plain_pickle(bytes(value), where)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_plain_pickles(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain_pickles(v, f"{where}[{i}]")


# -- DCP's .metadata: an interpreter of data opcodes with an exact table of globals ---------------


class _Record:
    """A DCP record class: built only as pickle builds a dataclass (NEWOBJ with no arguments,
    then BUILD with a dict of its declared fields), or by its own `__setstate__` (a tuple)."""

    def __init__(self, cls: type, check: Any = None, validate: Any = None) -> None:
        import dataclasses

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
            raise _Refused(f"{self.cls.__qualname__} state {_short(state)} is not its fields")
        inst.__dict__.update(state)

    def complete(self, inst: Any) -> None:
        """Refuse a record missing a field without default; make the fields that have a
        default factory (the others' defaults are class attributes)."""
        have = inst.__dict__
        if self.check is not None:
            if not have:
                raise _Refused(f"{self.cls.__qualname__} without its state")
        elif not self.required.issubset(have):
            missing = sorted(self.required - set(have))
            raise _Refused(f"{self.cls.__qualname__} without its field(s) {missing}")
        for name, factory in self.factories.items():
            if name not in have:
                have[name] = factory()
        if self.validate is not None:
            self.validate(inst)


def _size(*args: Any) -> torch.Size:
    if len(args) != 1 or type(args[0]) not in (tuple, list):
        raise _Refused(f"torch.Size{_short(args)}")
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
        raise _Refused(f"collections.OrderedDict{_short(args)}: only () or a list of pairs")
    return OrderedDict(pairs)


def _set_of(kind: type) -> Any:
    def build(*args: Any) -> Any:
        if not args:
            return kind()
        if len(args) != 1 or type(args[0]) not in (list, tuple):
            raise _Refused(f"{kind.__name__}{_short(args)}: only () or a list")
        return kind(args[0])

    return build


def _device(*args: Any) -> torch.device:
    if not (
        1 <= len(args) <= 2
        and type(args[0]) is str
        and len(args[0]) <= 32
        and (len(args) == 1 or type(args[1]) is int)
    ):
        raise _Refused(f"torch.device{_short(args)}")
    return torch.device(*args)


def _path_of(kind: type) -> Any:
    def build(*args: Any) -> Any:
        if not all(type(a) is str for a in args):
            raise _Refused(f"{kind.__name__}{_short(args)}: only str parts")
        return kind(*args)

    return build


def _dcp_tables() -> tuple[dict[tuple[str, str], Any], dict[int, _Record], frozenset[int]]:
    """(globals by exact (module, name), records by id of class, ids of constructors)."""
    import pathlib

    from torch.distributed.checkpoint import filesystem as fs
    from torch.distributed.checkpoint import metadata as md

    layouts = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}
    encodings = {e.value: e for e in md._MEM_FORMAT_ENCODING}

    def layout(*args: Any) -> torch.layout:
        if len(args) != 1 or type(args[0]) is not str or args[0] not in layouts:
            raise _Refused(f"torch layout {_short(args)}")
        return layouts[args[0]]

    def mem_format(*args: Any) -> Any:
        if len(args) != 1 or type(args[0]) is not int or args[0] not in encodings:
            raise _Refused(f"memory format encoding {_short(args)}")
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
            raise _Refused(f"TensorProperties state {_short(state)}")

    records: dict[type, _Record] = {
        cls: _Record(cls)
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
    records[md.TensorProperties] = _Record(md.TensorProperties, check=check_properties)
    records[fs._StorageInfo] = _Record(fs._StorageInfo, validate=_check_storage_info)
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
    return (
        table,
        {id(cls): rec for cls, rec in records.items()},
        frozenset(id(f) for f in constructors.values()),
    )


_DCP_TABLES: tuple[dict[tuple[str, str], Any], dict[int, _Record], frozenset[int]] | None = None

# Opcodes that can only call, import or look up things outside the data: refused by name.
_REFUSED_OPCODES = {
    b"P"[0]: "PERSID",
    b"Q"[0]: "BINPERSID",
    b"\x82"[0]: "EXT1",
    b"\x83"[0]: "EXT2",
    b"\x84"[0]: "EXT4",
    b"i"[0]: "INST",
    b"o"[0]: "OBJ",
    b"\x92"[0]: "NEWOBJ_EX",
    b"\x97"[0]: "NEXT_BUFFER",
    b"\x98"[0]: "READONLY_BUFFER",
}


class _Malformed(Exception):
    """The pickle is not a well-formed program (truncated, stack or memo misuse)."""


def _unpickle_dcp(data: bytes) -> Any:
    """Runs the pickle program in `data` admitting only data opcodes and the exact table of
    globals; REDUCE only on the table's checking constructors, NEWOBJ/BUILD only on DCP's
    records. Raises `_Refused` for anything else and `_Malformed` for a broken program."""
    global _DCP_TABLES
    if _DCP_TABLES is None:
        _DCP_TABLES = _dcp_tables()
    table, records, constructors = _DCP_TABLES
    unpack, decode = struct.unpack_from, bytes.decode
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    built: list[tuple[_Record, Any]] = []
    pos, end = 0, len(data)

    def take(n: int) -> bytes:
        nonlocal pos
        if n < 0 or pos + n > end:
            raise _Malformed("truncated")
        pos += n
        return data[pos - n : pos]

    def pop_mark() -> list[Any]:
        start = marks.pop()
        items = stack[start:]
        del stack[start:]
        return items

    while True:
        if pos >= end:
            raise _Malformed("truncated: no STOP")
        op = data[pos]
        pos += 1
        if op == 0x94:  # MEMOIZE
            memo[len(memo)] = stack[-1]
        elif op == 0x6A:  # LONG_BINGET
            stack.append(memo[unpack("<I", data, pos)[0]])
            pos += 4
        elif op == 0x68:  # BINGET
            stack.append(memo[data[pos]])
            pos += 1
        elif op == 0x29:  # EMPTY_TUPLE
            stack.append(())
        elif op == 0x81:  # NEWOBJ
            args = stack.pop()
            cls = stack[-1]
            rec = records.get(id(cls))
            if rec is None or rec.cls is not cls or args != ():
                raise _Refused(f"NEWOBJ of {_short(cls)}{_short(args)}: only DCP's records")
            inst: Any = object.__new__(cls)
            built.append((rec, inst))
            stack[-1] = inst
        elif op == 0x28:  # MARK
            marks.append(len(stack))
        elif op == 0x62:  # BUILD
            state = stack.pop()
            inst = stack[-1]
            rec = records.get(id(type(inst)))
            if rec is None:
                raise _Refused(f"BUILD of {_short(type(inst))}: only DCP's records")
            _call(rec.build, (inst, state))
        elif op == 0x7D:  # EMPTY_DICT
            stack.append({})
        elif op == 0x75:  # SETITEMS
            items = pop_mark()
            target = _target(stack, dict)
            if len(items) % 2:
                raise _Malformed("SETITEMS with a key and no value")
            for i in range(0, len(items), 2):
                target[items[i]] = items[i + 1]
        elif op == 0x8C:  # SHORT_BINUNICODE
            n = data[pos]
            stack.append(decode(data[pos + 1 : pos + 1 + n], "utf-8", "surrogatepass"))
            pos += 1 + n
        elif op == 0x4B:  # BININT1
            stack.append(data[pos])
            pos += 1
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x4D:  # BININT2
            stack.append(unpack("<H", data, pos)[0])
            pos += 2
        elif op == 0x86:  # TUPLE2
            stack[-2:] = [(stack[-2], stack[-1])]
        elif op == 0x52:  # REDUCE
            args = stack.pop()
            func = stack[-1]
            if id(func) not in constructors or type(args) is not tuple:
                raise _Refused(f"REDUCE of {_short(func)}: only the table's constructors")
            stack[-1] = _call(func, args)
        elif op == 0x71:  # BINPUT
            memo[data[pos]] = stack[-1]
            pos += 1
        elif op == 0x72:  # LONG_BINPUT
            memo[unpack("<I", data, pos)[0]] = stack[-1]
            pos += 4
        elif op == 0x5D:  # EMPTY_LIST
            stack.append([])
        elif op == 0x58:  # BINUNICODE
            stack.append(decode(take(unpack("<I", take(4))[0]), "utf-8", "surrogatepass"))
        elif op == 0x8D:  # BINUNICODE8
            stack.append(decode(take(unpack("<Q", take(8))[0]), "utf-8", "surrogatepass"))
        elif op == 0x4A:  # BININT
            stack.append(unpack("<i", take(4))[0])
        elif op == 0x8A:  # LONG1
            stack.append(int.from_bytes(take(take(1)[0]), "little", signed=True))
        elif op == 0x8B:  # LONG4
            stack.append(int.from_bytes(take(unpack("<i", take(4))[0]), "little", signed=True))
        elif op == 0x47:  # BINFLOAT
            stack.append(unpack(">d", take(8))[0])
        elif op == 0x4E:  # NONE
            stack.append(None)
        elif op == 0x88:  # NEWTRUE
            stack.append(True)
        elif op == 0x89:  # NEWFALSE
            stack.append(False)
        elif op == 0x43:  # SHORT_BINBYTES
            stack.append(take(take(1)[0]))
        elif op == 0x42:  # BINBYTES
            stack.append(take(unpack("<I", take(4))[0]))
        elif op == 0x8E:  # BINBYTES8
            stack.append(take(unpack("<Q", take(8))[0]))
        elif op == 0x87:  # TUPLE3
            stack[-3:] = [(stack[-3], stack[-2], stack[-1])]
        elif op == 0x74:  # TUPLE
            stack.append(tuple(pop_mark()))
        elif op == 0x61:  # APPEND
            item = stack.pop()
            _target(stack, list).append(item)
        elif op == 0x65:  # APPENDS
            items = pop_mark()
            _target(stack, list).extend(items)
        elif op == 0x73:  # SETITEM
            value, key = stack.pop(), stack.pop()
            _target(stack, dict)[key] = value
        elif op == 0x8F:  # EMPTY_SET
            stack.append(set())
        elif op == 0x90:  # ADDITEMS
            items = pop_mark()
            _target(stack, set).update(items)
        elif op == 0x91:  # FROZENSET
            stack.append(frozenset(pop_mark()))
        elif op == 0x93:  # STACK_GLOBAL
            name, module = stack.pop(), stack.pop()
            if type(module) is not str or type(name) is not str:
                raise _Refused("STACK_GLOBAL of something other than two names")
            stack.append(_lookup(table, module, name))
        elif op == 0x63:  # GLOBAL
            module_line = _line(data, pos)
            pos += len(module_line) + 1
            name_line = _line(data, pos)
            pos += len(name_line) + 1
            stack.append(_lookup(table, decode(module_line), decode(name_line)))
        elif op == 0x30:  # POP
            if marks and marks[-1] == len(stack):
                marks.pop()
            else:
                stack.pop()
        elif op == 0x31:  # POP_MARK
            pop_mark()
        elif op == 0x95:  # FRAME: a buffering hint; the whole pickle is in memory
            take(8)
        elif op == 0x80:  # PROTO
            if take(1)[0] > 5:
                raise _Malformed("unsupported pickle protocol")
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or marks:
                raise _Malformed("STOP with a stack that is not one value")
            for rec, inst in built:
                rec.complete(inst)
            return stack[0]
        elif op in _REFUSED_OPCODES:
            raise _Refused(f"opcode {_REFUSED_OPCODES[op]} (it calls or looks up code)")
        else:
            raise _Refused(f"opcode {bytes([op])!r} at byte {pos - 1} is not a data opcode")


def _line(data: bytes, pos: int) -> bytes:
    end = data.find(b"\n", pos, pos + 256)
    if end < 0:
        raise _Malformed("GLOBAL without its name")
    return data[pos:end]


def _lookup(table: dict[tuple[str, str], Any], module: str, name: str) -> Any:
    """The global (module, name) if the table has exactly it: no dotted-name walk, no import."""
    try:
        return table[(module, name)]
    except KeyError:
        raise _Refused(
            f"global {_short(f'{module}.{name}')} (not one of DCP's records, "
            "torch sizes/dtypes/layouts/devices or plain containers)"
        ) from None


def _target(stack: list[Any], kind: type) -> Any:
    """The container on top of the stack, if it is exactly `kind` (or an OrderedDict for a
    dict): items are never added to a record or anything else with its own methods."""
    target = stack[-1]
    if type(target) is not kind and not (kind is dict and type(target) is OrderedDict):
        raise _Refused(f"adding items to {_short(type(target))}")
    return target


def _check_storage_info(info: Any) -> None:
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
        raise _Refused(f"storage record {_short(vars(info))} (outside the checkpoint folder?)")


def _call(func: Any, args: tuple[Any, ...]) -> Any:
    """A checking constructor or record build; any failure inside it is a refusal."""
    try:
        return func(*args)
    except _Refused:
        raise
    except Exception as e:
        raise _Refused(f"{getattr(func, '__qualname__', func)} refused its arguments: {e}") from e


def load_dcp_metadata(data: bytes, where: str) -> Any:
    """The object DCP pickled into its `.metadata` file `where`, read by `_unpickle_dcp` (which
    builds only DCP's records, torch sizes/dtypes/layouts/devices and plain containers).
    Raises `UnsafeCheckpointError` for anything else, `CorruptCheckpointError` for a broken
    pickle. Called on: whichever ranks read the metadata."""
    collecting = gc.isenabled()
    gc.disable()  # a big metadata is ~100k young objects: collections would dominate the read
    try:
        return _unpickle_dcp(data)
    except _Refused as e:
        raise UnsafeCheckpointError(
            f"{where}: DCP metadata asks for {e}, which trainckpt does not load (it could run "
            "code); nothing from it was run. The checkpoint was crafted or is not a plain DCP "
            "checkpoint: load an older checkpoint or restore it from a trusted copy"
        ) from e
    except Exception as e:  # a broken program: truncated, stack or memo misuse
        raise CorruptCheckpointError(
            f"{where} cannot be read as DCP metadata ({type(e).__name__}: {_short(str(e))}); "
            "the checkpoint is damaged: restore it from a copy or use an older checkpoint"
        ) from e
    finally:
        if collecting:
            gc.enable()


__all__ = [
    "NoGlobalsUnpickler",
    "check_plain_pickle",
    "check_plain_pickles",
    "load_dcp_metadata",
    "load_torch_plain",
    "looks_like_pickle",
    "numpy_value_problem",
]
