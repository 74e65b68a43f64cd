"""What the `trainckpt` command tells a person who is waiting: a status line on stderr when a
remote store is slow to answer, and a quiet end when the reader of its output goes away."""

from __future__ import annotations

import logging
import os
import sys
import threading
from types import TracebackType

SLOW_AFTER = 2.0
"""Seconds of silence after which the command says what it is waiting for."""

# Loggers that report retries and credential look-ups while a remote store keeps us waiting.
_WAIT_LOGGERS = ("trainckpt", "google.api_core.retry", "google.auth", "botocore.retryhandler")


class SlowRemoteNotice:
    """While the block runs: if it is still running after `delay` seconds and one of
    `locations` is remote, print one line on stderr naming them and the retry deadline, and
    from then on show the retries those libraries log (one line each)."""

    def __init__(
        self, command: str, locations: list[str], timeout: float, delay: float = SLOW_AFTER
    ) -> None:
        self.command, self.locations, self.timeout = command, locations, timeout
        self.timer = threading.Timer(delay, self._say)
        self.timer.daemon = True
        self.levels: dict[str, int] = {}
        """Levels of the loggers made talkative, to restore."""
        self.lock = threading.Lock()  # the timer's thread may be speaking as the block ends
        self.done = False

    def __enter__(self) -> SlowRemoteNotice:
        if self.locations:
            self.timer.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.timer.cancel()
        with self.lock:
            self.done = True
        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)

    def _say(self) -> None:
        with self.lock:
            if not self.done:
                self._start_talking()

    def _start_talking(self) -> None:
        where = ", ".join(f"'{loc}'" for loc in self.locations)
        print(
            f"trainckpt {self.command}: waiting for {where} (each request is retried for up to "
            f"{self.timeout:g}s; --timeout SECONDS changes that)",
            file=sys.stderr,
            flush=True,
        )
        for name in _WAIT_LOGGERS:  # the command's log handler (stderr) then shows them
            logger = logging.getLogger(name)
            if logger.getEffectiveLevel() > logging.INFO:
                self.levels[name] = logger.level
                logger.setLevel(logging.DEBUG if name.startswith("google") else logging.INFO)


def silence_stdout() -> None:
    """After the reader of stdout went away (`trainckpt inspect X | head`): point stdout at
    /dev/null, so the interpreter's final flush does not fail again and print a traceback."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
