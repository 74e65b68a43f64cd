"""SIGKILL a real training run at random moments, many times over, on one save folder.

Each repetition restarts the run from whatever the previous kill left (resuming from the newest
good checkpoint, without save_overwrite), lets it save and delete for a random while, and kills
it. After every kill every checkpoint the finders report must load exactly the values saved for
its step; the last run must finish every step. The seed is fixed; the kill moments still fall
differently on each machine, which is the point: every run samples new interleavings.
"""

from __future__ import annotations

import random
import signal
import time

import pytest
from support.crash_worker import JOIN_TIMEOUT, KEEP, check_checkpoints, tmp_folders

pytestmark = pytest.mark.slow

REPETITIONS = 20
STEPS_PER_RUN = 4


def test_random_kills_never_leave_a_bad_checkpoint(launcher, tmp_path):
    rng = random.Random(20261121)
    folder, work = tmp_path / "run", str(tmp_path / "work")

    # One undisturbed run: how long STEPS_PER_RUN saves take here, to spread kills over.
    proc, ready = launcher.start(str(folder), work, STEPS_PER_RUN, "sync")
    assert ready.wait(JOIN_TIMEOUT)
    began = time.monotonic()
    proc.join(JOIN_TIMEOUT)
    span = time.monotonic() - began
    assert proc.exitcode == 0
    last = STEPS_PER_RUN

    killed = 0
    for rep in range(REPETITIONS):
        mode = rng.choice(["sync", "async"])
        last += STEPS_PER_RUN  # every run has new steps to save
        delay = rng.uniform(0.0, span)
        proc, ready = launcher.start(str(folder), work, last, mode)
        assert ready.wait(JOIN_TIMEOUT), "the run never got ready"
        began = time.monotonic()
        proc.join(delay)  # wakes early if the run ends; otherwise the kill comes at `delay`
        if proc.is_alive():
            proc.kill()  # SIGKILL
            killed += 1
        else:  # the machine got faster: aim the next kills at the shorter runs
            span = (span + time.monotonic() - began) / 2
        proc.join(JOIN_TIMEOUT)
        why = f"repetition {rep} ({mode}, kill after {delay:.3f}s)"
        assert proc.exitcode in (0, -signal.SIGKILL), f"{why}: the run failed: {proc.exitcode}"
        found = check_checkpoints(folder)
        assert len(found) <= KEEP + 1, f"{why}: {found}"  # one more while a delete was cut short

    # Most repetitions must have been cut short, or the test proved little.
    assert killed >= REPETITIONS // 4, f"only {killed} of {REPETITIONS} runs were killed"

    proc, _ready = launcher.start(str(folder), work, last + 2, "async")
    proc.join(JOIN_TIMEOUT)
    assert proc.exitcode == 0
    assert check_checkpoints(folder) == [last + 1, last + 2]
    assert not list(tmp_folders(folder))
