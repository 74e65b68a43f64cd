"""Trainer state (`torch.save` files): PyTorch's `weights_only` unpickler (its own list of tensor
and container globals) plus, scoped to the call, the numpy stand-ins of `numpy_values`.
"""

from __future__ import annotations

import io
import threading
import zipfile
from pathlib import Path
from typing import Any

import torch

from trainckpt.errors import CorruptCheckpointError, UnsafeCheckpointError
from trainckpt.format.safe_unpickle.numpy_values import (
    TORCH_EXTRA_GLOBALS,
    materialize,
    our_load,
)

# `safe_globals` adds to and removes from one process-wide set: one such load at a time.
_TORCH_LOAD_LOCK = threading.Lock()


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
        with _TORCH_LOAD_LOCK, torch.serialization.safe_globals(TORCH_EXTRA_GLOBALS):
            our_load.active = True
            try:
                obj = torch.load(
                    source, weights_only=True, map_location="cpu", mmap=isinstance(data, Path)
                )
            finally:
                our_load.active = False
        return materialize(obj, set())
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
