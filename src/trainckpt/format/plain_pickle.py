"""Vetting pickled bytes found inside a checkpoint before anything unpickles them.

Some trainers keep part of their state as `pickle.dumps` bytes (torchtitan's data loader
stores its position that way, and its `load_state_dict` calls `pickle.loads` on them). DCP
hands such bytes over as plain data, so the promise "loading never runs code from a checkpoint"
would end at the trainer's own `pickle.loads`. `check_plain_pickle` reads the bytes with an
unpickler that can build only plain data (no global is ever looked up), so bytes that pass
cannot run code when the trainer unpickles them, and bytes that do not pass are refused first.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from trainckpt.errors import UnsafeCheckpointError
from trainckpt.format.safe_unpickle import NoGlobalsUnpickler as _PlainUnpickler

_MAX_PICKLE_BYTES = 256 * 1024 * 1024


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
        _PlainUnpickler(io.BytesIO(data)).load()
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
    looks like a pickle."""
    if isinstance(value, (bytes, bytearray)):
        if looks_like_pickle(bytes(value)):
            check_plain_pickle(bytes(value), where)
    elif isinstance(value, dict):
        for k, v in value.items():
            check_plain_pickles(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            check_plain_pickles(v, f"{where}[{i}]")
