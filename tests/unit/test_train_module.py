"""`ModelAndOptim.state_dict_to_save` (one `get_state_dict` per part) holds what DCP's separate
model and optimizer state dicts hold, and leaves an optimizer that has not stepped unchanged."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)

from trainckpt import ModelAndOptim


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert list(a) == list(b)
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def test_the_state_to_save_is_dcps_model_and_optimizer_state_of_every_part() -> None:
    parts = [torch.nn.Sequential(torch.nn.Linear(4, 3)), torch.nn.Linear(3, 2)]
    parts[1].register_module("inner", torch.nn.Linear(2, 2))
    optims = [torch.optim.AdamW(p.parameters(), lr=0.01 * (i + 1)) for i, p in enumerate(parts)]
    fresh = torch.optim.AdamW(parts[1].parameters())  # never stepped
    for p, o in zip(parts, optims, strict=True):
        for param in p.parameters():
            param.grad = torch.ones_like(param)
        o.step()
        o.zero_grad(set_to_none=True)  # as after a step: DCP then steps a fresh one
    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    for used in (optims, [optims[0], fresh]):
        state = ModelAndOptim(parts, used).state_dict_to_save()
        assert not fresh.state  # saving never steps an optimizer
        model = {k: v for p in parts for k, v in get_model_state_dict(p, options=opts).items()}
        _same(state["model"], model)
        optim = {
            k: v
            for p, o in zip(parts, used, strict=True)
            for k, v in get_optimizer_state_dict(p, o, options=opts).items()
        }
        fresh.state.clear()  # DCP's call stepped it
        _same(state["optim"], optim)
