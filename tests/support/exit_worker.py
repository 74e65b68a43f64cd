"""A trainer that ends while its `save_async` is still writing, without `Checkpointer.close()`.

`python exit_worker.py FOLDER HOW EXIT_TIMEOUT WORK_DIR [ASYNC_WRITER]` saves `make_module()` to
`FOLDER/step1` with `save_async`, then ends at once, by `HOW`: `exit` (`sys.exit(0)`), `raise`
(an uncaught exception), `sigterm-handler` (SIGTERM, handled by a trainer handler that exits
with 143) or `sigterm-default` (SIGTERM with Python's default action). Logs go to stderr.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for `support`
from support.models import make_module  # noqa: E402
from trainckpt import CheckpointerConfig  # noqa: E402

HOWS = ("exit", "raise", "sigterm-handler", "sigterm-default")


def save_then_end(
    folder: str, how: str, exit_timeout: float, work_dir: str, async_writer: str = "thread"
) -> None:
    """Start an async save of step 1, then end the process by `how` before it commits.

    Called on: all ranks (a multi-rank job when torch.distributed is initialized)."""
    assert how in HOWS, how
    if how == "sigterm-handler":
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    ckpt = CheckpointerConfig(
        work_dir=work_dir,
        exit_timeout=exit_timeout,
        collective_timeout=30,
        async_writer=async_writer,  # type: ignore[arg-type]
    ).build()
    future = ckpt.save_async(f"{folder}/step1", make_module(), {"step": 1})
    logging.getLogger("exit_worker").info("save in flight at the end: %s", not future.done())
    if how == "exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("the trainer crashed (simulated)")
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(120)  # SIGTERM ends the process before this returns
    raise AssertionError("SIGTERM did not end the process")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    folder, how, exit_timeout, work_dir = sys.argv[1:5]
    save_then_end(folder, how, float(exit_timeout), work_dir, *sys.argv[5:6])
