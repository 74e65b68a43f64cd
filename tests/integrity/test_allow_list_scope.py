"""trainckpt's extra allow-list (numpy stand-ins for trainer state) is for its own loads only:
a user's own `torch.load(weights_only=True)` behaves as it would without trainckpt, after a
trainckpt load and while one runs on another thread (PyTorch keeps one process-wide list,
which trainckpt fills only during its loads; its stand-ins refuse any other load)."""

from __future__ import annotations

import io
import threading

import numpy as np
import pytest
import torch
from support.models import fresh_module, make_module

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _users_pickle() -> bytes:
    """What a user saves with numpy in it: it names numpy's `_reconstruct`, `ndarray` and
    `dtype`, which PyTorch's `weights_only` loader does not allow by default."""
    buf = io.BytesIO()
    torch.save({"a": np.arange(3), "s": np.float64(2.5)}, buf)
    return buf.getvalue()


def _users_load(data: bytes) -> str:
    """What the user's load did: loaded what, or refused which kind of global."""
    try:
        return f"loaded {torch.load(io.BytesIO(data), weights_only=True)!r}"
    except Exception as e:
        refused = "Unsupported global: GLOBAL numpy." in str(e)
        return f"{type(e).__name__}: {'a numpy global' if refused else e}"


def _unsupported(outcome: str) -> bool:
    return outcome == "UnpicklingError: a numpy global"


def test_after_a_trainckpt_load_the_users_own_load_is_as_without_it(ckpt, tmp_path):
    data = _users_pickle()
    without = _users_load(data)
    assert _unsupported(without), without

    path = ckpt.save(tmp_path / "run" / "step1", make_module(), {"a": np.arange(3)})
    assert ckpt.load(path, fresh_module())["a"].tolist() == [0, 1, 2]
    assert _users_load(data) == without
    left = [g for g in torch.serialization.get_safe_globals() if "trainckpt" in repr(g)]
    assert left == [], "trainckpt's allow-list outlived its load"


def test_while_trainckpt_loads_the_users_own_loads_on_other_threads_are_as_without_it(
    ckpt, tmp_path
):
    data = _users_pickle()
    registered = len(torch.serialization.get_safe_globals())
    without = _users_load(data)
    # Many numpy values: unpickling them keeps trainckpt's list registered for a while.
    state = {"values": [np.float64(i) for i in range(20_000)]}
    path = ckpt.save(tmp_path / "run" / "step1", make_module(), state)

    def ours_registered() -> bool:
        return len(torch.serialization.get_safe_globals()) > registered

    inside: list[str] = []  # outcomes of the user's loads that ran wholly while ours did
    done = threading.Event()

    def user() -> None:
        while not done.is_set():
            before = ours_registered()
            outcome = _users_load(data)
            if before and ours_registered():
                inside.append(outcome)

    thread = threading.Thread(target=user)
    thread.start()
    try:
        for _ in range(5):  # until the user's thread has run inside one of our loads
            assert ckpt.load(path, fresh_module())["values"][-1] == 19_999.0
            if inside:
                break
    finally:
        done.set()
        thread.join()
    assert inside, "no load of the user's thread ran while trainckpt loaded: nothing was tested"
    assert set(inside) == {without}, inside[:3]
