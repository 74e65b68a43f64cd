"""Test-only fault points: SIGKILL this process at a named step of the commit protocol.

Crash tests set `TRAINCKPT_FAULT_POINT` to one of `POINTS` in the process they want to kill; the
protocol calls `fault_point(name)` at each of those steps. Without the variable (always, outside
tests) a fault point is one dictionary lookup and does nothing.
"""

from __future__ import annotations

import os
import signal

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


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL when `TRAINCKPT_FAULT_POINT` names `name`.

    SIGKILL cannot be caught: no `finally`, no atexit, no flush runs, as in a power cut of one
    process. Called on: whichever rank reaches that step.
    """
    if os.environ.get(ENV_VAR) == name:
        os.kill(os.getpid(), signal.SIGKILL)
