"""The one retry policy of the remote back ends (HTTP, S3, GCS), configured in one place.

- What is retried: connection errors (refused, reset, timed out, a body cut short) and the
  statuses `RETRY_STATUS` (408, 429 and the 5xx a server sends when it is busy or restarting).
  Nothing else: a 403, a 404 or a failed precondition fails at once.
- How: exponential backoff with full jitter (each wait drawn from 0 up to a ceiling that starts
  at `INITIAL_DELAY` s and doubles up to `MAXIMUM_DELAY` s), google-api-core's
  `exponential_sleep_generator`.
- For how long: `StorageOptions.retry_deadline` seconds in total from the first attempt. A wait
  that would end past the deadline is not taken: the request fails then, naming the deadline.

HTTP and S3 run their requests through `RetryPolicy.call` (google-api-core's `retry_target`);
the GCS SDK runs its own loop, given `RetryPolicy.sdk_retry` (the same backoff and deadline,
the SDK's own list of transient errors, which is the same list).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from google.api_core.retry import (
    Retry,
    RetryFailureReason,
    exponential_sleep_generator,
    retry_target,
)

from trainckpt.storage.base import StorageOptions

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
"""HTTP statuses that say "try again": request timeout, too many requests, and the 5xx of a
busy or restarting server."""
INITIAL_DELAY = 0.25
"""Seconds: the ceiling of the first wait."""
MAXIMUM_DELAY = 10.0
"""Seconds: the ceiling of any wait."""
MULTIPLIER = 2.0
"""How the ceiling grows from one wait to the next."""


@dataclass(frozen=True)
class RetryPolicy:
    """How long and how often a request to a remote back end is tried again."""

    deadline: float
    """Seconds, in total from the first attempt (`StorageOptions.retry_deadline`)."""

    @classmethod
    def of(cls, options: StorageOptions) -> RetryPolicy:
        return cls(deadline=options.retry_deadline)

    def call(
        self,
        fn: Callable[[], T],
        transient: Callable[[Exception], bool],
        gave_up: Callable[[Exception, int], Exception],
        what: str,
    ) -> T:
        """`fn()`, tried again while it raises an error `transient` accepts, until the deadline;
        then `gave_up(last error, attempts)` is raised. Any other error is raised as it is.
        `what` (e.g. "GET 'http://...'") goes into the log line of each retry."""

        def retrying(e: Exception) -> None:
            log.info("%s: %s; retrying", what, e)

        def failure(
            errors: list[Exception], reason: RetryFailureReason, _timeout: float | None
        ) -> tuple[Exception, Exception | None]:
            last = errors[-1]
            if reason is RetryFailureReason.TIMEOUT:
                return gave_up(last, len(errors)), last
            cause = last.__cause__
            return last, cause if isinstance(cause, Exception) else None

        return retry_target(
            fn,
            transient,
            exponential_sleep_generator(INITIAL_DELAY, MAXIMUM_DELAY, MULTIPLIER),
            timeout=self.deadline,
            on_error=retrying,
            exception_factory=failure,
        )

    def sdk_retry(self, base: Retry) -> Retry:
        """`base`, an SDK's `Retry` (its predicate says what is transient), with this policy's
        backoff and deadline: for an SDK that runs the retry loop itself (google-cloud-storage)."""
        return base.with_delay(
            initial=INITIAL_DELAY, maximum=MAXIMUM_DELAY, multiplier=MULTIPLIER
        ).with_timeout(self.deadline)
