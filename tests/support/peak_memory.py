"""Peak memory of code run in a fresh interpreter, read from `resource`'s high-water mark
(`ru_maxrss`), which a sampling thread could miss but the kernel never does.

`run_measured(body)` runs `body` in a child Python with `measure(fn)` defined: it calls `fn`,
and returns what it returned or raised with how far the process's peak resident memory grew
during the call. `body` appends those outcomes to `results`, which the child prints as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import trainckpt

_PRELUDE = """
import json, resource

results = []

def peak():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux

def measure(fn):
    before = peak()
    try:
        outcome = {"returned": repr(fn())}
    except Exception as e:
        outcome = {"raised": type(e).__name__, "message": str(e)}
    outcome["growth"] = peak() - before
    return outcome
"""


def run_measured(body: str, timeout: float = 300) -> list[dict[str, Any]]:
    """Run `body` (after the prelude above) in a child interpreter that imports this
    worktree's `trainckpt` and the tests' `support`; return its `results`."""
    paths = [str(Path(trainckpt.__file__).parents[1]), str(Path(__file__).parents[1])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "NO_GCE_CHECK": "true"}
    code = _PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(results))\n"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
