"""Trainer state: the per-rank dict a trainer saves beside the model (step, data position, RNG
states, scheduler). It is stored with `torch.save` and loaded by `safe_unpickle.load_torch_plain`
(PyTorch's `weights_only` loader plus plain numpy values), so it may hold only plain types,
tensors and numpy arrays of numeric/bool dtypes; anything else is refused when saving, not a week
later when resuming."""

from __future__ import annotations

import io
from typing import Any

import torch

from trainckpt.errors import CorruptCheckpointError, InvalidTrainStateError
from trainckpt.format.safe_unpickle import load_torch_plain, numpy_value_problem

_PLAIN = (str, bytes, int, float, bool, type(None), torch.Tensor, torch.Size, torch.dtype)


def serialize_trainer_state(train_state: dict[str, Any], where: str) -> bytes:
    """`torch.save` bytes of the trainer state, refused now if they would not load back safely
    (so a bad type fails the save, not the resume a week later). Called on: every rank."""
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
    return buf.getvalue()


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
