"""Tensor flags read without letting go of the interpreter lock.

`Tensor.is_conj()`, `is_neg()` and `is_pinned()` are dispatched operators, and PyTorch's Python
bindings release the interpreter lock around every dispatched operator. Taking it back waits
while another thread runs Python code, up to the switch interval (`sys.setswitchinterval`).
Beside a busy thread (the training loop beside a background save, the other writer thread)
one such question about a small tensor took 30–180 µs instead of 0.3 µs. The paths that ask
them of every entry ask here (`docs/scale.md`, "Flags read without letting go of the lock").
"""

from __future__ import annotations

import functools

import torch

_dispatch_keys = getattr(torch._C, "_dispatch_keys", None)
_FLIPS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative)
_PLAIN_KEYS = None if _dispatch_keys is None else _dispatch_keys(torch.zeros(()))
"""The dispatch keys of a plain CPU tensor: most tensors asked about have exactly these."""


def flips_values(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a lazily conjugated or negated view (`is_conj()` or `is_neg()`):
    its storage does not hold its values. Read from its dispatch keys, where PyTorch keeps
    both bits."""
    if _dispatch_keys is None:  # pragma: no cover - a torch without the binding
        return tensor.is_conj() or tensor.is_neg()
    keys = _dispatch_keys(tensor)
    return keys != _PLAIN_KEYS and any(keys.has(k) for k in _FLIPS)


@functools.cache
def _pinning_possible() -> bool:
    """Whether this process has an accelerator: without one PyTorch pins no memory, and
    `is_pinned()` is False for every tensor (`at::Context::isPinnedPtr`)."""
    return torch.accelerator.current_accelerator() is not None


def is_pinned(tensor: torch.Tensor) -> bool:
    """`tensor.is_pinned()`, asked only of a CPU tensor in a process with an accelerator
    (pinned memory is CPU memory, and needs one)."""
    return tensor.is_cpu and _pinning_possible() and tensor.is_pinned()
