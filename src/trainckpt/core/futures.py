"""`CallbacksFirstFuture`: the future `save_async` returns. Its done-callbacks have all run
before `result()` (or `exception()`) returns in any other thread.

A plain `concurrent.futures.Future` wakes its waiters first and runs its callbacks afterwards,
in the thread that completed it. Trainers hang bookkeeping on those callbacks: OLMo-core's
records a metric from one. Its main thread waits for the save (`result()`) and then reduces its
metrics across ranks, so with a plain future a callback may still add a metric on one rank and
not yet on another: the ranks then reduce different tensors and the job dies on a collective
mismatch. Here a waiter resumes only once the callbacks are done.

It also remembers whether its error was raised to anyone (`result()`), so the checkpointer's
next call raises a failed save's error only if nobody has seen it yet (`result_once`): an error
is raised once.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class CallbacksFirstFuture(Future[T]):
    """Completed with `resolve` / `fail` by one thread; waiters in other threads return only
    after every done-callback ran. A callback may itself call `result()` (it does not wait)."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks_ran = threading.Event()
        self._completer: int | None = None
        self._error_seen = False

    def resolve(self, value: T) -> None:
        self._complete(lambda: self.set_result(value))

    def fail(self, error: BaseException) -> None:
        self._complete(lambda: self.set_exception(error))

    def _complete(self, complete: Any) -> None:
        self._completer = threading.get_ident()
        try:
            complete()  # wakes the waiters, then runs the callbacks in this thread
        finally:
            self._callbacks_ran.set()

    def _wait_for_callbacks(self, timeout: float | None) -> None:
        if threading.get_ident() != self._completer:
            self._callbacks_ran.wait(timeout)

    def result(self, timeout: float | None = None) -> T:
        try:
            return super().result(timeout)
        except BaseException as e:
            if self.done() and e is self._exception:  # type: ignore[attr-defined]
                self._error_seen = True  # not a timeout of this wait: the save's own error
            raise
        finally:
            if self.done():
                self._wait_for_callbacks(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)  # a look, not a raise: the library's own observers
        self._wait_for_callbacks(timeout)  # (logging, retention, exit hooks) call it too
        return error

    @property
    def error_seen(self) -> bool:
        """True once `result()` or `result_once()` raised the error."""
        return self._error_seen

    def result_once(self) -> T | None:
        """Wait for the outcome; return the result, or raise the error unless a `result()` call
        already raised it (then return None). Called by the
        checkpointer's next call after an async save (training thread)."""
        error = super().exception()  # waits; hands out nothing
        self._wait_for_callbacks(None)
        if error is None:
            return self.result()
        if self._error_seen:
            return None
        self._error_seen = True
        raise error
