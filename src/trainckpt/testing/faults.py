"""Test-only fault points: SIGKILL this process at a named step of the commit protocol, or run
a hook there.

Crash tests set `TRAINCKPT_FAULT_POINT` to one of `POINTS` in the process they want to kill; the
protocol calls `fault_point(name)` at each of those steps. In-process tests can instead run a
hook at a point (`on_fault_point`). Without either (always, outside tests) a fault point is two
dictionary lookups and does nothing.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager

ENV_VAR = "TRAINCKPT_FAULT_POINT"

POINTS = (
    "writing-shards",  # this rank's trainer state is written, its DCP shards are not
    "after-shards",  # every file of this rank is written, nothing recorded yet
    "before-manifest",  # rank 0, all files written (and uploaded), no `.manifest.json` yet
    "before-commit-record",  # rank 0, `.manifest.json` written, `.metadata.json` not
    "before-rename",  # rank 0, `<dir>-tmp` complete with both records, not renamed yet
    "after-rename",  # rank 0, `<dir>` renamed into place, other ranks not told yet
    "during-delete",  # a deletion removed `.metadata.json` and nothing else yet
)
"""Points of the save folder's commit protocol (each is reached by every save)."""

LOCAL_POINTS = (  # the node-local tier (local/tier.py)
    "local-writing",  # this rank's module state of its part is written, its trainer state not
    "local-replicating",  # the first chunk of every replica (and restore copy) went out
    "local-between-phases",  # every part and replica durable and agreed, no commit marker yet
    "local-cleanup",  # retention removed an old step's commit markers, not its parts yet
    "local-restore-checked",  # a restore's copy of this rank's part is checked, not loaded yet
)
"""Points of the node-local tier's save and restore (`local-cleanup`: only when a step is
deleted; `local-restore-checked`: in restores)."""

REPLACE_POINTS = (  # only saves that replace an old folder of their step (core/commit_*.py)
    "replacing",  # rank 0, the old folder moved aside to `<dir>-replaced`, the new not in place
    # (filesystems: `-tmp` not renamed; object stores: the old objects copied aside and
    # deleted from `<dir>`, nothing of the new uploaded)
    "copying-aside",  # object stores: old files copied to `<dir>-replaced`, its marker not
    "replaced",  # object stores: the new checkpoint committed, `<dir>-replaced` not deleted
)
"""Points of a save over an old folder of its step (overwritten, abandoned by a rollback)."""

WRITER_POINTS = (  # the writer process of async saves (core/writer_process.py)
    "writer-process-writing",  # the writer process wrote the first item of a shard file
)
"""Points inside the writer process (`async_writer="process"`)."""

INCREMENTAL_POINTS = (  # only saves that reuse files of the previous one (core/incremental.py)
    "reused-file",  # this rank linked (or copied) its first unchanged file, wrote no shard yet
)
"""Points of an incremental save that takes files over from the previous checkpoint."""


_hooks: dict[str, Callable[[], None]] = {}


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL when `TRAINCKPT_FAULT_POINT` names `name`; run the hook
    a test set for `name` with `on_fault_point`, if any.

    SIGKILL cannot be caught: no `finally`, no atexit, no flush runs, as in a power cut of one
    process. Called on: whichever rank reaches that step.
    """
    if os.environ.get(ENV_VAR) == name:
        os.kill(os.getpid(), signal.SIGKILL)
    hook = _hooks.get(name)
    if hook is not None:
        hook()


@contextmanager
def on_fault_point(name: str, hook: Callable[[], None]) -> Iterator[None]:
    """Test-only: run `hook` in this process each time the protocol reaches point `name`
    (e.g. delete a working folder at a known moment), until the block ends."""
    known = POINTS + REPLACE_POINTS + LOCAL_POINTS + WRITER_POINTS + INCREMENTAL_POINTS
    if name not in known:
        raise ValueError(f"unknown fault point {name!r}; known: {known}")
    _hooks[name] = hook
    try:
        yield
    finally:
        _hooks.pop(name, None)
