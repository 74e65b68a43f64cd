"""Loaders that can only build data: the one module that decides what a checkpoint's pickles may
name. A security boundary: nothing read from a checkpoint is ever called, imported or executed.

- Trainer state (`torch.save` files) is read by PyTorch's `weights_only` unpickler (its own list
  of tensor and container globals) plus, scoped to the call, exactly the numpy globals below,
  which here are stand-ins that accept only plain numeric/bool arrays, scalars and dtypes.
- DCP's `.metadata` (a plain protocol-2..5 pickle, which PyTorch's unpickler cannot read) is read
  by `load_dcp_metadata` (in `safe_unpickle_dcp`... see below): an interpreter of the data
  opcodes only, whose globals are an exact table of fully qualified names.

Every refusal is an `UnsafeCheckpointError`; a file whose container is damaged (a torn zip) is a
`CorruptCheckpointError`. Both name the file.
"""

from __future__ import annotations

import io
import math
import pickle
import threading
import zipfile
from typing import Any

import torch

from .errors import CorruptCheckpointError, UnsafeCheckpointError


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
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _numpy() -> Any:
    """numpy, imported only when a checkpoint names it (numpy is optional)."""
    try:
        import numpy
    except ImportError as e:  # pragma: no cover - numpy ships with every supported torch
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


class _NumpyDType:
    """Stands in for `numpy.dtype` while unpickling: built only from a plain dtype code, and
    given only the state numpy writes for one (a byte order)."""

    code: str
    value: Any = None

    def __new__(cls, code: Any = None, align: Any = False, copy: Any = True, *rest: Any) -> Any:
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
    if subtype is not _NumpyArray or shape != (0,) or dtype != b"b":
        raise _Refused(f"numpy _reconstruct{_short((subtype, shape, dtype))} is not a plain array")
    return _NumpyArray()


def _numpy_scalar(dtype: Any, raw: Any = None) -> Any:
    """`numpy.core.multiarray.scalar`: a numpy scalar from a plain dtype and its raw bytes."""
    if type(dtype) is not _NumpyDType or type(raw) is not bytes:
        raise _Refused("numpy scalar of something other than a plain dtype and its bytes")
    dt = dtype.built()
    if len(raw) != dt.itemsize:
        raise _Refused(f"numpy scalar of dtype {dt} given {len(raw)} bytes")
    return _numpy().frombuffer(raw, dtype=dt, count=1)[0]


def _empty_bytes(*args: Any) -> bytes:
    """`bytes()`: how protocol 2 pickles `b""` (e.g. the data of an empty array)."""
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


def _damaged_container(data: bytes) -> str | None:
    """Why `data` is not an intact `torch.save` file (a zip whose CRCs match, or a legacy
    pickle stream), or None. An intact file that does not load was refused, not damaged."""
    if data[:2] != b"PK":
        return None if data[:1] == b"\x80" else "not a torch.save file"
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            bad = z.testzip()
            if bad is not None:
                return f"zip member {bad} fails its CRC"
            if not any(n.endswith("data.pkl") for n in z.namelist()):
                return "no data.pkl in the zip"
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        return f"torn zip archive ({e})"
    return None


def load_torch_plain(data: bytes, where: str) -> Any:
    """What `torch.save` wrote into `data` (the file `where`), loaded with PyTorch's
    `weights_only` unpickler plus the numpy stand-ins: tensors, plain containers and scalars,
    numpy arrays/scalars/dtypes of plain dtypes. Raises `UnsafeCheckpointError` for anything
    else and `CorruptCheckpointError` for a damaged file; nothing from it is ever run."""
    try:
        with _TORCH_LOAD_LOCK, torch.serialization.safe_globals(_TORCH_EXTRA_GLOBALS):
            obj = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
        return _materialize(obj, set())
    except Exception as e:
        reason = f"{type(e).__name__}: {_first_line(e)}"
        damage = _damaged_container(data)
        if damage is not None:
            raise CorruptCheckpointError(
                f"'{where}' is damaged ({damage}; {reason}); nothing from it was run. Restore "
                "it from a copy or load an older checkpoint"
            ) from e
        raise UnsafeCheckpointError(
            f"'{where}' holds more than plain data and is not loaded ({reason}); nothing from "
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


__all__ = ["load_torch_plain", "numpy_value_problem"]
