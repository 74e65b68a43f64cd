"""Python's cyclic garbage collector paused while a save or a load does its bookkeeping.

A state of thousands of entries makes DCP allocate hundreds of thousands of small objects (plan
items, indices, sizes) that live until the step ends. Each 700 allocations start a collection,
and every few of them a full one that walks the whole heap (the model, the optimizer, the
trainer's objects): with 16,000 entries that walking took about as long as the bookkeeping
itself, and it grows with the heap, not with the checkpoint. Nothing DCP allocates here forms
reference cycles that must be freed before the step ends, so automatic collection is paused for
the step and resumes after it (its garbage is collected then, as usual).

The pause is process-wide (Python has no per-thread collector): while a background save holds
it, the training thread's cycles wait for the save to finish too. Nested and concurrent pauses
(a save while a load, two saves) are counted; collection resumes when the last one ends, and
only if it was on when the first began: a trainer that turned it off keeps it off.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_was_enabled = False


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause automatic garbage collection for the block (see the module's docstring).
    Called on: any rank, any thread."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
