"""numpy values in trainer state (`torch.save` files): stand-ins for exactly numpy's
reconstruction globals, which build only plain numeric/bool arrays, scalars and dtypes.

`load_torch_plain` admits them, scoped to its own call, beside PyTorch's `weights_only` list;
`materialize` then swaps each stand-in for the real value it built.
"""

from __future__ import annotations

import math
import pickle
import threading
from typing import Any

from trainckpt.format.safe_unpickle.refusal import Refused, short

# numpy's pickled dtype codes of the plain dtypes: bool, signed/unsigned ints, float16/32/64,
# complex64/128. Not admitted: object, strings, void/structured, datetimes, longdouble.
_PLAIN_DTYPE_CODES = frozenset(
    {"b1", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8", "c8", "c16"}
)
_PLAIN_DTYPE_STATE_TAIL = (None, None, None, -1, -1, 0)


def _numpy() -> Any:
    """numpy, imported only when a checkpoint names it (numpy is optional)."""
    try:
        import numpy
    except ImportError as e:
        raise Refused("the file holds numpy values but numpy is not installed") from e
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


our_load = threading.local()
"""`active` is True in the thread running `load_torch_plain`'s `torch.load`, and only there."""


def _only_in_our_loads(name: str) -> None:
    """Refuse a stand-in to any `torch.load` but ours. PyTorch's allow-list is one process-wide
    set, so while we load, a `weights_only` load the user runs on another thread could reach
    our stand-ins by name; it then fails as it would without trainckpt, instead of building
    them. Called by every stand-in first."""
    if not getattr(our_load, "active", False):
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
            raise Refused(f"numpy.dtype{short((code, align, copy, *rest))} is not a plain dtype")
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
            raise Refused(f"numpy dtype state {short(state)} is not that of a plain dtype")
        dtype = _numpy().dtype(self.code)
        self.value = dtype.newbyteorder(state[1]) if state[1] in "<>" else dtype

    def __hash__(self) -> int:
        raise Refused("a numpy dtype used as a dict key or set member")

    def built(self) -> Any:
        if self.value is None:
            raise Refused("a numpy dtype without its state")
        return self.value


class _NumpyArray:
    """Stands in for `numpy.ndarray` while unpickling: its state must be a plain dtype and raw
    bytes of exactly the size of the shape; the real array is a fresh copy of those bytes."""

    value: Any = None

    def __new__(cls, *args: Any) -> Any:
        _only_in_our_loads("numpy.ndarray")
        if args:
            raise Refused(f"numpy.ndarray{short(args)}: only an empty array to fill is built")
        return object.__new__(cls)

    def __setstate__(self, state: Any) -> None:
        if self.value is not None or type(state) is not tuple or len(state) != 5:
            raise Refused("numpy array state is not (version, shape, dtype, order, bytes)")
        version, shape, dtype, fortran, raw = state
        if (
            version != 1
            or type(shape) is not tuple
            or not all(type(n) is int and n >= 0 for n in shape)
            or type(dtype) is not _NumpyDType
            or type(fortran) is not bool
            or type(raw) is not bytes
        ):
            raise Refused("numpy array state is not that of a plain array")
        dt = dtype.built()
        count = math.prod(shape)
        if count * dt.itemsize != len(raw):
            raise Refused(f"numpy array of shape {shape} given {len(raw)} bytes of data")
        flat = _numpy().frombuffer(raw, dtype=dt, count=count)
        self.value = flat.reshape(shape, order="F" if fortran else "C").copy(order="K")

    def __hash__(self) -> int:
        raise Refused("a numpy array used as a dict key or set member")

    def built(self) -> Any:
        if self.value is None:
            raise Refused("a numpy array without its data")
        return self.value


def _numpy_reconstruct(subtype: Any, shape: Any, dtype: Any) -> _NumpyArray:
    """`numpy.core.multiarray._reconstruct` as numpy's own pickles call it, and only so."""
    _only_in_our_loads("numpy.core.multiarray._reconstruct")
    if subtype is not _NumpyArray or shape != (0,) or dtype != b"b":
        raise Refused(f"numpy _reconstruct{short((subtype, shape, dtype))} is not a plain array")
    return _NumpyArray()


def _numpy_scalar(dtype: Any, raw: Any = None) -> Any:
    """`numpy.core.multiarray.scalar`: a numpy scalar from a plain dtype and its raw bytes."""
    _only_in_our_loads("numpy.core.multiarray.scalar")
    if type(dtype) is not _NumpyDType or type(raw) is not bytes:
        raise Refused("numpy scalar of something other than a plain dtype and its bytes")
    dt = dtype.built()
    if len(raw) != dt.itemsize:
        raise Refused(f"numpy scalar of dtype {dt} given {len(raw)} bytes")
    return _numpy().frombuffer(raw, dtype=dt, count=1)[0]


def _empty_bytes(*args: Any) -> bytes:
    """`bytes()`: how protocol 2 pickles `b""` (e.g. the data of an empty array)."""
    _only_in_our_loads("builtins.bytes")
    if args:
        raise Refused(f"bytes{short(args)}: only bytes() is built")
    return b""


# What trainer state may name besides PyTorch's own `weights_only` list: (stand-in, exact name).
# numpy 1.x pickles say `numpy.core`, numpy 2 `numpy._core`.
TORCH_EXTRA_GLOBALS: list[Any] = [
    (_NumpyArray, "numpy.ndarray"),
    (_NumpyDType, "numpy.dtype"),
    (_numpy_reconstruct, "numpy.core.multiarray._reconstruct"),
    (_numpy_reconstruct, "numpy._core.multiarray._reconstruct"),
    (_numpy_scalar, "numpy.core.multiarray.scalar"),
    (_numpy_scalar, "numpy._core.multiarray.scalar"),
    (_empty_bytes, "builtins.bytes"),
]
_STAND_INS = frozenset(id(g) for g, _ in TORCH_EXTRA_GLOBALS)


def materialize(obj: Any, seen: set[int]) -> Any:
    """`obj` with the numpy stand-ins replaced by the real values they built, in place in
    lists and dicts (they are fresh from the unpickler); a stand-in left unbuilt, or a bare
    global used as a value, is refused. Real numpy values (from globals the user allowed
    process-wide) must be plain too."""
    t = type(obj)
    if t is _NumpyArray or t is _NumpyDType:
        return obj.built()
    if id(obj) in _STAND_INS:
        raise Refused(f"{short(obj)} as a value, not called")
    if t.__module__.startswith("numpy"):
        problem = numpy_value_problem(obj)
        if problem is not None:
            raise Refused(f"{problem} is not plain data")
        return obj
    if isinstance(obj, (dict, list)):
        if id(obj) in seen:
            return obj
        seen.add(id(obj))
        if isinstance(obj, dict):
            for key, value in list(obj.items()):
                materialize(key, seen)
                obj[key] = materialize(value, seen)
        else:
            obj[:] = [materialize(v, seen) for v in obj]
        return obj
    if t is tuple:
        items = [materialize(v, seen) for v in obj]
        return obj if all(a is b for a, b in zip(items, obj, strict=True)) else tuple(items)
    if t is set or t is frozenset:
        for v in obj:
            materialize(v, seen)
    return obj
