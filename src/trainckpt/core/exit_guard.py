"""Finish the in-flight async saves when the process ends without `Checkpointer.close()`.

A process that returns from its main function, raises, calls `sys.exit` or is sent SIGTERM
while a `save_async` is still writing would otherwise lose that save without a word: at exit,
`concurrent.futures` refuses new work, so the save thread fails at its next task (a shard
write, an upload) and nobody reads its error.

Two hooks, both bounded by each checkpointer's `exit_timeout`:

- a `threading` exit hook, which the interpreter runs after the main thread ends and before
  `concurrent.futures` refuses new work (its own hook is registered earlier, and these hooks
  run last-registered first); plain `atexit` would run too late;
- a SIGTERM handler, installed by `save_async` only where SIGTERM still has its default action
  (the trainer's own handler is never replaced): it waits the same way, then restores the
  default action and sends SIGTERM again, so the process still ends by that signal.

Either way the outcome is logged: an ERROR names every save that did not commit, and why.

A third hook, at `atexit` (after every thread of the process, the save threads too, has
ended), makes each live checkpointer destroy the gloo group it created. Left to the
interpreter's finalization, that group's worker threads may still be releasing a finished
collective's tensors, which needs the interpreter lock; during finalization that kills the
thread inside C++ code and the process aborts ("terminate called without an active
exception", SIGABRT).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 -- its exit hook must be registered before ours
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Protocol

log = logging.getLogger(__name__)


class Guarded(Protocol):
    """What the hooks need of a checkpointer."""

    exit_timeout: float
    collective_timeout: float

    def in_flight(self) -> tuple[str, Future[str]] | None:
        """The target and future of the async save nobody has waited for yet, if any."""
        ...

    def _release_own_group(self) -> None:
        """Destroy the process group the checkpointer created, if any, and drop it."""
        ...


_ENDS_LATER = (
    "the process ends once the save stops (new work is refused; a peer that does not answer "
    "fails it within collective_timeout=%.0fs)"
)

_live: weakref.WeakValueDictionary[int, Guarded] = weakref.WeakValueDictionary()
_lock = threading.RLock()  # re-entered when SIGTERM arrives while the main thread holds it


def track(ckpt: Guarded) -> None:
    """Finish `ckpt`'s in-flight save and destroy its own group at exit (held weakly: a
    checkpointer collected earlier is not kept alive). Called by its constructor."""
    with _lock:
        _live[id(ckpt)] = ckpt


def watch(ckpt: Guarded) -> None:
    """Also finish `ckpt`'s in-flight save on SIGTERM. Called by `save_async` (the SIGTERM
    handler is installed only when called on the main thread)."""
    track(ckpt)
    if threading.current_thread() is threading.main_thread():
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)


def finish_in_flight(why: str, *, ends_now: bool) -> None:
    """Wait (each checkpointer's `exit_timeout` at most) for every save not waited for yet,
    and log what became of it; `ends_now` when the process ends right after (SIGTERM) rather
    than once the save threads stop (exit). Never raises."""
    try:
        _finish(why, ends_now)
    except Exception:  # an exit hook must not fail the exit; say what went wrong instead
        log.exception("could not wait for the in-flight saves (%s)", why)


def _finish(why: str, ends_now: bool) -> None:
    with _lock:
        saves = [(c, s) for c in list(_live.values()) if (s := c.in_flight()) is not None]
    start = time.monotonic()
    for ckpt, (dir, future) in saves:
        if not future.done():
            log.warning(
                "%s: waiting up to %.0fs for the save of '%s' to commit (call "
                "Checkpointer.close() before exiting to wait for it; exit_timeout sets this wait)",
                why,
                ckpt.exit_timeout,
                dir,
            )
            wait([future], timeout=max(0.0, ckpt.exit_timeout - (time.monotonic() - start)))
        if not future.done():
            log.error(
                "the save of '%s' did not commit within %.0fs (%s) and is abandoned: %s. An "
                "abandoned save is not a checkpoint; the next save of that step clears it",
                dir,
                ckpt.exit_timeout,
                why,
                "the process ends now" if ends_now else _ENDS_LATER % ckpt.collective_timeout,
            )
            if not ends_now:
                future.add_done_callback(_report_late(dir))
        elif (error := future.exception()) is not None:
            log.error(
                "the save of '%s' failed and is lost (%s: %s); it is not a checkpoint",
                dir,
                type(error).__name__,
                error,
            )


def _report_late(dir: str) -> Callable[[Future[str]], None]:
    def report(future: Future[str]) -> None:
        error = future.exception()
        if error is None:
            log.warning("the abandoned save of '%s' committed after all", dir)
        else:
            log.error(
                "the abandoned save of '%s' is lost (%s: %s)", dir, type(error).__name__, error
            )

    return report


def _at_exit() -> None:
    finish_in_flight("the process is exiting", ends_now=False)


def _release_groups() -> None:
    """Every live checkpointer destroys the group it created (its gloo threads end now, while
    the interpreter can still run them). Never raises."""
    with _lock:
        live = list(_live.values())
    for ckpt in live:
        try:
            ckpt._release_own_group()
        except Exception:  # an exit hook must not fail the exit
            log.exception("could not destroy a checkpointer's process group at exit")


def _on_sigterm(signum: int, frame: object) -> None:
    finish_in_flight("SIGTERM received", ends_now=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


threading._register_atexit(_at_exit)  # type: ignore[attr-defined]
atexit.register(_release_groups)
