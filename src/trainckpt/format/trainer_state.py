"""Trainer state: the per-rank dict a trainer saves beside the model (step, data position, RNG
states, scheduler). It is stored with `torch.save` and loaded by `safe_unpickle.load_torch_plain`
(PyTorch's `weights_only` loader plus plain numpy values), so it may hold only plain types,
tensors and numpy arrays of numeric/bool dtypes; anything else is refused when saving, not a week
later when resuming.

A trainer-state file is read whole, so it is bounded like a record: `read_trainer_state` refuses
one larger than `max_trainer_state_bytes` (`DEFAULT_MAX_BYTES` unless configured) by its size,
before reading a byte of it, and saving refuses a state that would exceed the bound."""

from __future__ import annotations

import io
from typing import Any

import torch

from trainckpt.errors import CorruptCheckpointError, InvalidTrainStateError
from trainckpt.format.safe_unpickle import load_torch_plain, numpy_value_problem
from trainckpt.storage import Storage

DEFAULT_MAX_BYTES = 1024**3
"""Largest trainer-state file read by default (`CheckpointerConfig.max_trainer_state_bytes`).
A trainer's state (step, data position, RNG states, scheduler) is kilobytes to a few MB."""

_PLAIN = (str, bytes, int, float, bool, type(None), torch.Tensor, torch.Size, torch.dtype)


def serialize_trainer_state(
    train_state: dict[str, Any], where: str, max_bytes: int = DEFAULT_MAX_BYTES
) -> bytes:
    """`torch.save` bytes of the trainer state, refused now if they would not load back safely
    or are larger than `max_bytes` (so a bad type fails the save, not the resume a week later).
    Called on: every rank."""
    if not isinstance(train_state, dict):
        raise InvalidTrainStateError(
            f"trainer state for '{where}' must be a dict, got {type(train_state).__name__}"
        )
    culprits = _non_plain(train_state)
    if culprits:
        raise _not_plain(where, ", ".join(culprits[:5]))
    buf = io.BytesIO()
    try:
        torch.save(train_state, buf)
        load_torch_plain(buf.getvalue(), f"'{where}'")
    except Exception as e:
        raise _not_plain(where, str(e)) from e
    if buf.tell() > max_bytes:
        raise InvalidTrainStateError(
            f"trainer state for '{where}' takes {buf.tell()} bytes, more than "
            f"max_trainer_state_bytes={max_bytes}, so it could not be loaded back; keep large "
            "data in the train module's state, or raise max_trainer_state_bytes (for saving "
            "and loading alike)"
        )
    return buf.getvalue()


def read_trainer_state(storage: Storage, where: str, max_bytes: int) -> bytes:
    """The bytes of the trainer-state file `where`: refused by its size (one stat or HEAD)
    before any byte is read when larger than `max_bytes`, and read with a bound of
    `max_bytes + 1` so a file that grows meanwhile (or a server that sends more) is refused too.
    A missing file raises `FileNotFoundError`. Called on: every rank (its own file)."""
    size = storage.size(where)
    if size <= max_bytes:
        data = storage.read_bytes(where, 0, max_bytes + 1)
        size = len(data)
        if size <= max_bytes:
            return data
    raise CorruptCheckpointError(
        f"'{where}' holds {size} bytes, more than max_trainer_state_bytes={max_bytes} that a "
        "trainer-state file is read with; it was not read. If the checkpoint is yours and its "
        "trainer state is that large, raise max_trainer_state_bytes; otherwise the file is "
        "damaged: load an older checkpoint or restore it from a copy"
    )


def _not_plain(where: str, culprits: str) -> InvalidTrainStateError:
    return InvalidTrainStateError(
        f"trainer state for '{where}' holds objects that cannot be loaded back safely: "
        f"{culprits}; keep it to plain types (dict, list, tuple, str, int, float, bool, None), "
        "tensors, and numpy arrays, scalars and dtypes of numeric or bool dtypes (such as "
        "np.random.get_state()): convert other objects first, e.g. object arrays to lists and "
        "RNG objects to their state"
    )


def _non_plain(obj: Any, key: str = "") -> list[str]:
    """Key paths and types of the values in `obj` that are not plain data, for error messages."""
    if type(obj).__module__.startswith("numpy"):
        problem = numpy_value_problem(obj)
        return [] if problem is None else [f"'{key}' is {problem}"]
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _non_plain(v, f"{key}.{k}" if key else str(k))]
    if type(obj) in (list, tuple, set, frozenset):
        return [p for i, v in enumerate(obj) for p in _non_plain(v, f"{key}[{i}]")]
    if isinstance(obj, _PLAIN):
        return []
    return [f"'{key}' is a {type(obj).__module__}.{type(obj).__qualname__}"]


def deserialize_trainer_state(data: bytes, where: str) -> dict[str, Any]:
    """The trainer state `where` holds; `UnsafeCheckpointError` if it is not plain data,
    `CorruptCheckpointError` if it is damaged. Called on: every rank (its own file)."""
    state = load_torch_plain(data, f"'{where}'")
    if not isinstance(state, dict):
        raise CorruptCheckpointError(
            f"'{where}' holds {type(state).__name__}, not a dict of trainer state; load an "
            "older checkpoint or restore it from a copy"
        )
    return state
