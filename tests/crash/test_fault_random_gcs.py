"""Crash safety on gs:// at random moments: SIGKILL runs saving to a real fake-gcs-server on
127.0.0.1 many times over one prefix. After every kill, each checkpoint the finders report passes
a deep verify and loads exactly the values saved for its step; the last run completes every
step. Killing the server itself: `test_fault_server_gcs.py`.
"""

from __future__ import annotations

import random
import signal
import time

import pytest
from support.crash_worker import (
    JOIN_TIMEOUT,
    KEEP,
    check_checkpoints,
    finish,
    start_on_gcs,
)

pytestmark = pytest.mark.slow


def test_gcs_random_kills(launcher, gcs_server, gcs_bucket, tmp_path):
    rng = random.Random(4242)
    url = f"{gcs_bucket}/run"
    proc, ready = start_on_gcs(launcher, tmp_path, url, gcs_server.url, 3, "sync")
    assert ready.wait(JOIN_TIMEOUT)
    began = time.monotonic()
    assert finish(proc) == 0
    span = time.monotonic() - began

    last, killed = 3, 0
    for rep in range(8):
        mode = rng.choice(["sync", "async"])
        last += 3
        delay = rng.uniform(0.0, span)
        proc, ready = start_on_gcs(launcher, tmp_path, url, gcs_server.url, last, mode)
        assert ready.wait(JOIN_TIMEOUT)
        began = time.monotonic()
        proc.join(delay)  # wakes early if the run ends
        if proc.is_alive():
            proc.kill()  # SIGKILL
            killed += 1
        else:  # the machine got faster: aim the next kills at the shorter runs
            span = (span + time.monotonic() - began) / 2
        code = finish(proc)
        why = f"repetition {rep} ({mode}, kill after {delay:.3f}s)"
        assert code in (0, -signal.SIGKILL), f"{why}: the run failed with exit code {code}"
        found = check_checkpoints(url, tmp_path / "check")
        assert len(found) <= KEEP + 1, f"{why}: {found}"
    assert killed >= 2, f"only {killed} of 8 runs were killed"

    proc, _ = start_on_gcs(launcher, tmp_path, url, gcs_server.url, last + 2, "async")
    assert finish(proc) == 0
    assert check_checkpoints(url, tmp_path / "check") == [last + 1, last + 2]
