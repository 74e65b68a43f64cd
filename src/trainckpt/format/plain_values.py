"""Small immutable values saved as DCP byte items: serialized and parsed once per distinct value.

A flattened optimizer state holds a byte item for every hyperparameter of every parameter
(`param_groups.<fqn>.lr`, `.betas`, `.eps`, ...): eleven per parameter for AdamW, nearly all
equal. DCP serializes each with `torch.save` (a zip archive, ~0.1 ms) and a load parses each
again; at thousands of parameters that was most of a save's and a load's time (`docs/scale.md`).

`torch.save` of such a value writes bytes that depend on the value alone, so the bytes of each
distinct value are kept (`saved_bytes`), and a load keeps what it parsed from each distinct
item (`Parsed`): equal bytes parse to an equal value. Only immutable plain values qualify
(None, bool, int, float, complex, short str and bytes, and short tuples of them), so a value
handed out twice can never be changed through one of its holders. Both caches are bounded.
Called on: every rank, from its writer and reader threads.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Callable, Hashable
from typing import Any

import torch

MAX_VALUES = 4096
"""Distinct values each cache holds; when full, it starts over."""
MAX_TEXT = 256
"""Longest str or bytes that is cached."""
MAX_TUPLE = 16
"""Longest tuple that is cached."""
MAX_ITEM_BYTES = 4096
"""Longest serialized item whose parse is cached (a small value's archive is ~1.2 KB)."""


def value_key(value: Any) -> Hashable | None:
    """What determines `torch.save(value)`'s bytes, or None if `value` is not an immutable plain
    value this module caches. Floats are keyed by their bits: 0.0 and -0.0 are equal in Python
    and differ on disk."""
    kind = type(value)
    if value is None or kind is bool or kind is int:
        return (kind, value)
    if kind is float:
        return (kind, struct.pack("<d", value))
    if kind is complex:
        return (kind, struct.pack("<dd", value.real, value.imag))
    if kind is str or kind is bytes:
        return (kind, value) if len(value) <= MAX_TEXT else None
    if kind is tuple and len(value) <= MAX_TUPLE:
        keys = tuple(value_key(v) for v in value)
        return None if any(k is None for k in keys) else (kind, keys)
    return None


def _keep(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """Add to a bounded cache (emptied when full). Each step is one dict operation under the
    interpreter lock, so threads may share the cache."""
    if len(cache) >= MAX_VALUES:
        cache.clear()
    cache[key] = value


_saved: dict[Hashable, bytes] = {}


def saved_bytes(value: Any) -> bytes:
    """`torch.save(value)`'s bytes, made once per distinct immutable plain value."""
    key = value_key(value)
    found = _saved.get(key) if key is not None else None
    if found is not None:
        return found
    out = io.BytesIO()
    torch.save(value, out)
    data = out.getvalue()
    if key is not None:
        _keep(_saved, key, data)
    return data


class Parsed:
    """What each distinct small byte item parsed to, for one load: items with the same bytes
    hold the same value, so the (safe) parser runs once per distinct item. A result is kept
    only if it is an immutable plain value."""

    def __init__(self) -> None:
        self._values: dict[bytes, Any] = {}
        self.lookup = self._values.get
        """`lookup(data, default)`: the value an item of the bytes `data` parsed to, or
        `default` (`known` without a call of its own: once per byte item of a load)."""

    def known(self, data: bytes) -> Any:
        """The value an item of the bytes `data` parsed to, or `MISSING`."""
        return self._values.get(data, MISSING)

    def value(self, data: bytes, parse: Callable[[bytes], Any]) -> Any:
        """`parse(data)`, or the value an item of the same bytes parsed to."""
        found = self._values.get(data, MISSING)
        if found is not MISSING:
            return found
        value = parse(data)
        if len(data) <= MAX_ITEM_BYTES and value_key(value) is not None:
            _keep(self._values, data, value)
        return value


MISSING: Any = object()
"""What `Parsed.known` returns for bytes not parsed yet."""
