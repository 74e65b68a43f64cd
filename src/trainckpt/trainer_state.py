"""Trainer state: the per-rank dict a trainer saves beside the model (step, data position, RNG
states, scheduler). It is stored with `torch.save` and loaded with `weights_only=True`, so it may
hold only plain types and tensors; anything else is refused when saving, not a week later when
resuming."""

from __future__ import annotations

import io
from typing import Any

import torch

from .errors import CorruptCheckpointError, InvalidTrainStateError


def serialize_trainer_state(train_state: dict[str, Any], where: str) -> bytes:
    """`torch.save` bytes of the trainer state, refused now if they would not load back with
    `weights_only=True` (so a bad type fails the save, not the resume a week later)."""
    if not isinstance(train_state, dict):
        raise InvalidTrainStateError(
            f"trainer state for '{where}' must be a dict, got {type(train_state).__name__}"
        )
    buf = io.BytesIO()
    try:
        torch.save(train_state, buf)
        data = buf.getvalue()
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        culprits = ", ".join(_non_plain(train_state)[:5]) or _unsupported_global(e)
        raise InvalidTrainStateError(
            f"trainer state for '{where}' holds objects that cannot be loaded back safely "
            f"(with torch.load(weights_only=True)): {culprits}; keep it to plain types "
            "(dict, list, tuple, str, int, float, bool, None) and tensors: convert other "
            "objects first, e.g. numpy arrays with torch.from_numpy and RNG states with "
            "torch.get_rng_state()"
        ) from e
    return data


_PLAIN = (str, bytes, int, float, bool, type(None), torch.Tensor, torch.Size, torch.dtype)


def _non_plain(obj: Any, key: str = "") -> list[str]:
    """Key paths and types of the values in `obj` that are not plain data, for error messages."""
    if isinstance(obj, dict):
        return [p for k, v in obj.items() for p in _non_plain(v, f"{key}.{k}" if key else str(k))]
    if type(obj) in (list, tuple, set, frozenset):
        return [p for i, v in enumerate(obj) for p in _non_plain(v, f"{key}[{i}]")]
    if isinstance(obj, _PLAIN):
        return []
    return [f"'{key}' is a {type(obj).__module__}.{type(obj).__qualname__}"]


def _unsupported_global(error: Exception) -> str:
    """The line of torch's weights_only error that names the refused type, if there is one."""
    lines = [ln.strip() for ln in str(error).splitlines() if "GLOBAL" in ln]
    return lines[0] if lines else type(error).__name__


def deserialize_trainer_state(data: bytes, where: str) -> dict[str, Any]:
    try:
        state = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as e:
        raise CorruptCheckpointError(
            f"'{where}' cannot be loaded as plain trainer state ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); nothing from it was run. The file is "
            "damaged or unsafe: load an older checkpoint or restore it from a copy"
        ) from e
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"'{where}' holds {type(state).__name__}, not a dict")
    return state
