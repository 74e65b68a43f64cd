"""A shorter interpreter-lock switch interval while a background save runs.

A background save's bookkeeping (staging, DCP's planning, exchanging and encoding the
metadata) is Python code on the save thread, which holds the interpreter lock. The training
thread gives the lock up around every PyTorch operation and takes it back right after; when the
save thread holds it then, the training thread waits until the save thread lets go, which it
does only when asked, after the switch interval (`sys.setswitchinterval`, 5 ms by default). A
training step of a hundred operations can so wait a hundred times 5 ms. With thousands of
entries that was most of the training time a background save cost (docs/scale.md).

While a background save runs the interval is at most `INTERVAL`, so each of those waits is at
most that long; the save thread's own work takes a little longer, the training loop much less.
The interval is process-wide (CPython has one): it is restored when the last background save
ends, unless someone else changed it meanwhile (their value is kept). Saves that overlap are
counted, as `gc_pause` counts its pauses.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

INTERVAL = 0.0005
"""Seconds: the switch interval while a background save runs (CPython's default is 0.005)."""

_lock = threading.Lock()
_holders = 0
_previous = 0.0


@contextmanager
def short_switch_interval() -> Iterator[None]:
    """Keep the interpreter's switch interval at most `INTERVAL` for the block (see the
    module's docstring). Called on: any rank, the checkpointer's save thread."""
    global _holders, _previous
    with _lock:
        if _holders == 0:
            _previous = sys.getswitchinterval()
            if _previous > INTERVAL:
                sys.setswitchinterval(INTERVAL)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            # getswitchinterval() returns the value in whole microseconds
            ours = abs(sys.getswitchinterval() - min(_previous, INTERVAL)) < 1e-6
            if _holders == 0 and ours:
                sys.setswitchinterval(_previous)
