"""Pickled bytes that a trainer keeps inside its state, vetted with no globals at all.

torchtitan's data loader stores its position as `pickle.dumps` bytes and its `load_state_dict`
calls `pickle.loads` on them (DCP hands them over as plain data). `check_plain_pickles` vets
them first with `NoGlobalsUnpickler`, which admits no global: bytes that pass cannot run code
when the trainer unpickles them, and bytes that do not are refused before it does.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from trainckpt.errors import UnsafeCheckpointError
from trainckpt.format.safe_unpickle.refusal import short

_MAX_PICKLE_BYTES = 256 * 1024 * 1024


class NoGlobalsUnpickler(pickle.Unpickler):
    """Builds dicts, lists, tuples, sets, str, bytes, numbers, bool and None only: every global
    (by GLOBAL, STACK_GLOBAL, INST or an extension code) and every persistent id is refused, so
    no REDUCE, NEWOBJ or BUILD has anything to call."""

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpointError(f"the pickle refers to {short(f'{module}.{name}')}")

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
