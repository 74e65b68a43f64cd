"""CallbacksFirstFuture: a waiter in another thread resumes only after the done-callbacks ran."""

from __future__ import annotations

import threading
import time

import pytest

from trainckpt.core.futures import CallbacksFirstFuture


@pytest.mark.parametrize("outcome", ["value", "error"])
def test_waiters_resume_after_the_callbacks(outcome):
    for _ in range(20):  # the race a plain Future loses: waiter wakes, callback still running
        future: CallbacksFirstFuture[str] = CallbacksFirstFuture()
        seen: list[str] = []

        def callback(f: CallbacksFirstFuture[str], seen: list[str] = seen) -> None:
            if outcome == "value":
                assert f.result() == "done"  # a callback may call result(): no deadlock
            time.sleep(0.01)
            seen.append("callback")

        future.add_done_callback(callback)
        completer = threading.Thread(
            target=future.resolve if outcome == "value" else future.fail,
            args=("done" if outcome == "value" else RuntimeError("boom"),),
        )
        completer.start()
        if outcome == "value":
            assert future.result(timeout=10) == "done"
        else:
            with pytest.raises(RuntimeError, match="boom"):
                future.result(timeout=10)
        assert seen == ["callback"]
        completer.join()


def test_timeout_before_completion_still_raises():
    future: CallbacksFirstFuture[int] = CallbacksFirstFuture()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)
    future.resolve(1)
    assert future.result() == 1 and future.exception() is None
