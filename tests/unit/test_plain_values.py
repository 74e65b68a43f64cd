"""Small values saved as DCP byte items are serialized and parsed once per distinct value
(`format/plain_values.py`); what comes back must be exactly what a fresh `torch.save` and a
fresh parse give, never a value another holder could change, and a crafted item is still
refused."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support.models import TinyNet, assert_same_state

from trainckpt import CheckpointerConfig, ModelAndOptim, UnsafeCheckpointError
from trainckpt.format import plain_values
from trainckpt.format.safe_unpickle import load_torch_plain


def _torch_save(value: Any) -> bytes:
    out = io.BytesIO()
    torch.save(value, out)
    return out.getvalue()


@pytest.mark.parametrize(
    "value",
    [None, True, 1, 0.0, -0.0, math.inf, 1e-3, 1 + 2j, "adamw", b"x", (0.9, 0.999), ((1, 2), "a")],
)
def test_the_bytes_are_torch_saves_own(value: Any) -> None:
    assert plain_values.saved_bytes(value) == _torch_save(value)
    assert plain_values.saved_bytes(value) == _torch_save(value)  # the cached bytes too


def test_equal_values_of_other_kinds_keep_their_own_bytes() -> None:
    """0.0 == -0.0 and True == 1 in Python; on disk they differ, and so must the cache's."""
    assert plain_values.saved_bytes(0.0) != plain_values.saved_bytes(-0.0)
    assert plain_values.saved_bytes(1) != plain_values.saved_bytes(True)
    assert plain_values.saved_bytes((1,)) != plain_values.saved_bytes((1.0,))
    assert torch.load(io.BytesIO(plain_values.saved_bytes(-0.0))) == 0.0
    assert math.copysign(1, torch.load(io.BytesIO(plain_values.saved_bytes(-0.0)))) == -1


@pytest.mark.parametrize("value", [[1, 2], {"a": 1}, (1, [2]), "x" * 1000, torch.zeros(2)])
def test_mutable_or_large_values_are_not_cached(value: Any) -> None:
    assert plain_values.value_key(value) is None


def test_a_parsed_mutable_value_is_never_shared() -> None:
    parsed = plain_values.Parsed()
    data = _torch_save({"lr": 0.1})
    first = parsed.value(data, lambda d: load_torch_plain(d, "test"))
    first["lr"] = 99.0  # a holder changes its copy
    again = parsed.value(data, lambda d: load_torch_plain(d, "test"))
    assert again == {"lr": 0.1} and again is not first


def test_each_distinct_item_is_parsed_once() -> None:
    parsed = plain_values.Parsed()
    calls: list[bytes] = []

    def parse(data: bytes) -> Any:
        calls.append(data)
        return load_torch_plain(data, "test")

    items = [_torch_save(v) for v in (1e-3, (0.9, 0.999), 1e-3, 1e-3, (0.9, 0.999), -0.0, 0.0)]
    values = [parsed.value(d, parse) for d in items]
    assert values == [1e-3, (0.9, 0.999), 1e-3, 1e-3, (0.9, 0.999), -0.0, 0.0]
    assert math.copysign(1, values[5]) == -1 and math.copysign(1, values[6]) == 1
    assert len(calls) == 4


def test_a_crafted_item_beside_cached_ones_is_still_refused(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (Path.touch, (marker,))

    parsed = plain_values.Parsed()
    good = _torch_save(0.5)
    assert parsed.value(good, lambda d: load_torch_plain(d, "good")) == 0.5
    with pytest.raises(UnsafeCheckpointError):
        parsed.value(_torch_save(Evil()), lambda d: load_torch_plain(d, "evil"))
    assert not marker.exists()


def _two_groups(seed: int) -> ModelAndOptim:
    torch.manual_seed(seed)
    model = TinyNet()
    params = list(model.parameters())
    optim = torch.optim.AdamW(
        [{"params": params[:3], "lr": 0.5, "betas": (0.8, 0.9)}, {"params": params[3:]}],
        lr=1e-2,
    )
    model(torch.randint(0, 64, (2, 4))).sum().backward()
    optim.step()
    return ModelAndOptim(model, optim)


def test_a_saved_optimizer_state_comes_back_whole(tmp_path: Path) -> None:
    """Every hyperparameter of every parameter group round-trips, with two groups whose values
    differ (the cache must not hand one group's values to the other)."""
    module, other = _two_groups(0), _two_groups(1)
    assert other.optim is not None
    for group in other.optim.param_groups:
        group.update(lr=3.0, betas=(0.1, 0.2))
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    try:
        ckpt.save(tmp_path / "step1", module, {"step": 1})
        ckpt.load(tmp_path / "step1", other)
    finally:
        ckpt.close()
    assert_same_state(module, other)
    groups = other.optim.state_dict()["param_groups"]
    assert (groups[0]["lr"], groups[0]["betas"]) == (0.5, (0.8, 0.9))
    assert (groups[1]["lr"], groups[1]["betas"]) == (1e-2, (0.9, 0.999))
