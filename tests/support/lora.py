"""A fine-tuning-shaped module for incremental-save tests: a frozen base (not in the optimizer,
~97% of the saved bytes) and a small trained adapter."""

from __future__ import annotations

import torch

from trainckpt import ModelAndOptim

BASE = 1024
BASE_BYTES = (BASE * BASE + BASE) * 4
"""Bytes of the frozen base's tensors."""


def lora_module(seed: int = 0) -> ModelAndOptim:
    torch.manual_seed(seed)
    base = torch.nn.Linear(BASE, BASE)
    base.requires_grad_(False)
    model = torch.nn.Sequential(base, torch.nn.Linear(BASE, 4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    return ModelAndOptim(model, torch.optim.AdamW(trainable, lr=1e-2))


def train(module: ModelAndOptim, step: int) -> None:
    """One optimizer step of the adapter, on inputs that depend only on `step`."""
    gen = torch.Generator().manual_seed(step)
    module.model(torch.randn(8, BASE, generator=gen)).square().sum().backward()
    assert module.optim is not None
    module.optim.step()
    module.optim.zero_grad()


def copy_of(module: ModelAndOptim) -> ModelAndOptim:
    """An independent copy of `module`'s model and optimizer state."""
    dst = lora_module(seed=99)
    dst.model.load_state_dict(module.model.state_dict())
    assert dst.optim is not None and module.optim is not None
    dst.optim.load_state_dict(module.optim.state_dict())
    return dst
