"""What the benchmarks share: the state to save, a timer, and checks that a load restored it."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import torch

from trainckpt import ModelAndOptim


class Timer:
    """`with Timer() as t: ...` then `t.seconds`."""

    def __enter__(self) -> Timer:
        self._start = time.perf_counter()
        self.seconds = 0.0
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._start


def make_module(size_mb: float, seed: int = 0) -> ModelAndOptim:
    """A stack of square fp32 linear layers with AdamW state: `size_mb` MB in all (parameters
    plus the two moments, 12 bytes per parameter), after one real optimizer step."""
    n_params = max(1, int(size_mb * 1e6 / 12))
    width = max(16, min(4096, int(math.sqrt(n_params / 12)) // 16 * 16))
    layers = max(1, round(n_params / (width * width)))
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(width, width, bias=False) for _ in range(layers)))
    return after_one_step(model)


def after_one_step(model: torch.nn.Module) -> ModelAndOptim:
    """`model` with AdamW state, after one real optimizer step (so the moments exist)."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optim.step()
    optim.zero_grad(set_to_none=True)
    return ModelAndOptim(model, optim)


def state_tensors(state: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(dotted key, tensor) of every tensor in a nested state dict, in a stable order."""
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k in sorted(state, key=str):
            yield from state_tensors(state[k], f"{prefix}.{k}" if prefix else str(k))


def zero_state(module: ModelAndOptim) -> None:
    """Zero every parameter and optimizer tensor, so a load that restores nothing is caught."""
    with torch.no_grad():
        for p in module.model.parameters():
            p.zero_()
        if module.optim is not None:
            for st in module.optim.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        v.zero_()


def fingerprint(module: ModelAndOptim) -> list[float]:
    """Exact float64 sums of every tensor of the state (cheap; equal after a correct load)."""
    state = module.state_dict_to_save()
    return [float(t.sum(dtype=torch.float64)) for _, t in state_tensors(state)]
