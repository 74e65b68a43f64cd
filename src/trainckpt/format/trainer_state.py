"""Trainer state: the per-rank dict a trainer saves beside the model (step, data position, RNG
states, scheduler). It is stored with `torch.save` and loaded by `safe_unpickle.load_torch_plain`
(PyTorch's `weights_only` loader plus plain numpy values), so it may hold only plain types,
tensors and numpy arrays of numeric/bool dtypes; anything else is refused when saving, not a week
later when resuming.

A trainer-state file is format 1, the plain dict `torch.save` wrote (what OLMo-core writes and
reads), unless some tensor of the state was on a GPU. Such a state is written from its CPU copy
(staged like the module's tensors), as format 2: `{FORMAT_KEY: 2, "state": the dict, every
tensor on the CPU, "devices": [(path, device index), ...]}`, a path being the dict keys and
list indices that lead to a tensor. Loading gives those tensors to a `to_device` callback
(the checkpointer's puts them on the rank's current GPU). Earlier trainckpt versions and
OLMo-core read a format-2 file as that wrapper dict: keep GPU tensors out of a trainer state
they load.

A trainer-state file is read whole, so it is bounded like a record: `read_trainer_state` refuses
one larger than `max_trainer_state_bytes` (`DEFAULT_MAX_BYTES` unless configured) by its size,
before reading a byte of it, and saving refuses a state that would exceed the bound."""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any

import torch

from trainckpt.errors import CorruptCheckpointError, InvalidTrainStateError
from trainckpt.format.safe_unpickle import load_torch_plain, numpy_value_problem
from trainckpt.storage import Storage

DEFAULT_MAX_BYTES = 1024**3
"""Largest trainer-state file read by default (`CheckpointerConfig.max_trainer_state_bytes`).
A trainer's state (step, data position, RNG states, scheduler) is kilobytes to a few MB."""

FORMAT_KEY = "trainckpt_trainer_state"
"""The key that marks a trainer-state file of format 2 or later (its value: the format)."""
FORMAT_VERSION = 2

TensorPath = tuple[Any, ...]
"""Where a tensor is in a trainer state: the dict keys and list/tuple indices leading to it."""
ToDevice = Callable[[torch.Tensor, int], torch.Tensor]
"""Puts a loaded CPU tensor that was saved from GPU `device` where it belongs now."""

_PLAIN = (str, bytes, int, float, bool, type(None), torch.Tensor, torch.Size, torch.dtype)


def check_trainer_state(train_state: Any, where: str) -> None:
    """Refuse a trainer state that is no dict or holds values that would not load back safely.
    Called on: every rank, on the training thread."""
    if not isinstance(train_state, dict):
        raise InvalidTrainStateError(
            f"trainer state for '{where}' must be a dict, got {type(train_state).__name__}"
        )
    culprits = _non_plain(train_state)
    if culprits:
        raise _not_plain(where, ", ".join(culprits[:5]))


def serialize_trainer_state(
    train_state: dict[str, Any],
    where: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    devices: Sequence[tuple[TensorPath, int]] = (),
) -> bytes:
    """`torch.save` bytes of the trainer state, refused now if they would not load back safely
    or are larger than `max_bytes` (so a bad type fails the save, not the resume a week later).
    `devices`: the GPU each tensor at a path came from (its value here is the CPU copy); none
    writes format 1. Called on: every rank."""
    check_trainer_state(train_state, where)
    body: dict[str, Any] = train_state
    if devices:
        body = {FORMAT_KEY: FORMAT_VERSION, "state": train_state, "devices": list(devices)}
    buf = io.BytesIO()
    try:
        torch.save(body, buf)
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


def deserialize_trainer_state(
    data: bytes, where: str, to_device: ToDevice | None = None
) -> dict[str, Any]:
    """The trainer state `where` holds (format 1 or 2); `UnsafeCheckpointError` if it is not
    plain data, `CorruptCheckpointError` if it is damaged. Tensors saved from a GPU are handed
    to `to_device` with that GPU's index; without it they stay on the CPU.
    Called on: every rank (its own file)."""
    state = load_torch_plain(data, f"'{where}'")
    devices: dict[TensorPath, int] = {}
    if isinstance(state, dict) and FORMAT_KEY in state:
        state, devices = _unwrap(state, where)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(
            f"'{where}' holds {type(state).__name__}, not a dict of trainer state; load an "
            "older checkpoint or restore it from a copy"
        )
    found: set[TensorPath] = set()

    def place(path: TensorPath, t: torch.Tensor) -> torch.Tensor:
        if path not in devices:
            return t
        found.add(path)
        return t if to_device is None else to_device(t, devices[path])

    state = map_tensors(state, place)
    if found != set(devices):
        missing = sorted(map(str, set(devices) - found))
        raise CorruptCheckpointError(
            f"'{where}' records GPU tensors at {', '.join(missing[:5])} that its state does "
            "not hold; load an older checkpoint or restore it from a copy"
        )
    return state


def _unwrap(body: dict[Any, Any], where: str) -> tuple[Any, dict[TensorPath, int]]:
    """The state and the device of each GPU tensor of a format-2 file."""
    version = body[FORMAT_KEY]
    if version != FORMAT_VERSION or set(body) != {FORMAT_KEY, "state", "devices"}:
        raise CorruptCheckpointError(
            f"'{where}' is a trainer-state file of format {version!r} with keys "
            f"{sorted(map(str, body))}; this trainckpt reads formats 1 and {FORMAT_VERSION}: "
            "load it with the trainckpt that wrote it, or restore the file from a copy"
        )
    devices: dict[TensorPath, int] = {}
    for entry in body["devices"] if isinstance(body["devices"], list) else [None]:
        if not (
            isinstance(entry, tuple)
            and len(entry) == 2
            and isinstance(entry[0], tuple)
            and type(entry[1]) is int
            and entry[1] >= 0
        ):
            raise CorruptCheckpointError(
                f"'{where}' has a damaged list of GPU tensors ({entry!r} is no (path, device "
                "index) pair); load an older checkpoint or restore it from a copy"
            )
        devices[entry[0]] = entry[1]
    return body["state"], devices


def map_tensors(
    obj: Any, fn: Callable[[TensorPath, Any], Any], kind: type = torch.Tensor, path: TensorPath = ()
) -> Any:
    """`obj` with every value of type `kind` (tensors) reached through dicts, lists and tuples
    replaced by `fn(its path, it)`; the containers are new, other values the same objects."""
    if isinstance(obj, kind):
        return fn(path, obj)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn, kind, (*path, k)) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(map_tensors(v, fn, kind, (*path, i)) for i, v in enumerate(obj))
    return obj
