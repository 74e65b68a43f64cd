"""What every loader of the boundary raises while it reads: a refusal, and how a value from a
checkpoint is quoted in a message (cut short: an attacker chooses its size)."""

from __future__ import annotations

import pickle
from typing import Any


class Refused(pickle.UnpicklingError):
    """A pickle asked for something the allow-list does not admit (raised while unpickling, so
    PyTorch's loader passes it through as an `UnpicklingError`)."""


def short(value: Any) -> str:
    """repr of a value from a checkpoint, cut short."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):  # an integer too long to print, or too deep
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= 80 else text[:77] + "..."
