"""`BackgroundSaves`: the part of a `Checkpointer` that runs one async save at a time on its save
thread, and hands a failed save's error to the next call. Apart so the save path reads alone.
Called on: all ranks (training thread; the save itself on the save thread)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import cast

from trainckpt.core import exit_guard
from trainckpt.core.futures import CallbacksFirstFuture
from trainckpt.core.switch_interval import short_switch_interval
from trainckpt.errors import CheckpointError


def _failed(target: str, error: Exception) -> CheckpointError:
    failed = CheckpointError(
        f"the async save of '{target}' failed ({type(error).__name__}: {error}); nothing of "
        "it was committed: fix the cause and save again"
    )
    failed.__cause__ = error
    return failed


class BackgroundSaves:
    """The save thread of a `Checkpointer` (a mix-in: the checkpointer sets these attributes)."""

    _executor: ThreadPoolExecutor
    _lock: threading.Lock
    _pending: CallbacksFirstFuture[str] | None
    _pending_dir: str
    _staging: Future[None] | None

    def _in_background(
        self, target: str, run: Callable[[], str], staging: Future[None]
    ) -> Future[str]:
        """Run `run` (the write and commit of a staged save of `target`) on the save thread;
        return the future of its result, which waiters see only after the caller's
        done-callbacks ran (see `futures.py`). Called on: all ranks (training thread)."""
        committed: CallbacksFirstFuture[str] = CallbacksFirstFuture()

        def run_and_resolve() -> None:
            try:
                with short_switch_interval():  # the training thread waits less for the lock
                    path = run()
            except Exception as e:
                committed.fail(e if isinstance(e, CheckpointError) else _failed(target, e))
            except BaseException as e:
                committed.fail(e)
            else:
                committed.resolve(path)

        with self._lock:
            self._staging = staging
            self._pending_dir = target
            self._pending = committed
            self._executor.submit(run_and_resolve)
            exit_guard.watch(cast(exit_guard.Guarded, self))  # a Checkpointer
            return committed

    def in_flight(self) -> tuple[str, Future[str]] | None:
        """The target and future of the async save not waited for yet, if any: a failed one
        whose error its future already handed out is not (read without the lock: the exit
        hooks call it, possibly while the main thread holds the lock)."""
        pending = self._pending
        if pending is None or pending.error_seen:
            return None
        return self._pending_dir, pending

    def wait_for_staging(self) -> None:
        """Block until the state of the last `save_async(..., overlap_staging=True)` is copied
        to CPU memory; call it before the optimizer step that follows that save. Returns at
        once when nothing is being staged. Raises if staging failed."""
        with self._lock:
            staging = self._staging
        if staging is not None:
            staging.result()

    def wait(self) -> str | None:
        """Wait for the in-flight async save, if any; return its path or raise its error."""
        return self._finish_pending()

    def _finish_pending(self) -> str | None:
        """Wait for the async save not waited for yet; return its path, or raise its error
        as it is (its own type) unless its future already handed it out: an error is raised
        once. Called on: all ranks (training thread)."""
        with self._lock:
            pending, target, self._pending = self._pending, self._pending_dir, None
        if pending is None:
            return None
        try:
            return pending.result_once()
        except Exception as e:
            e.add_note(f"(raised by the next checkpointer call: the async save of '{target}')")
            raise
