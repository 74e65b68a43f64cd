"""`CallbacksFirstFuture`: the future `save_async` returns. Its done-callbacks have all run
before `result()` (or `exception()`) returns in any other thread.

A plain `concurrent.futures.Future` wakes its waiters first and runs its callbacks afterwards,
in the thread that completed it. Trainers hang bookkeeping on those callbacks: OLMo-core's
records a metric from one. Its main thread waits for the save (`result()`) and then reduces its
metrics across ranks, so with a plain future a callback may still add a metric on one rank and
not yet on another: the ranks then reduce different tensors and the job dies on a collective
mismatch. Here a waiter resumes only once the callbacks are done.
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
        finally:
            if self.done():
                self._wait_for_callbacks(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        error = super().exception(timeout)
        self._wait_for_callbacks(timeout)
        return error
