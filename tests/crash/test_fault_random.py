"""SIGKILL a real training run at random moments, many times over, on one save folder: a local
folder, a gs:// prefix on a real fake-gcs-server and an s3:// prefix on moto, on 127.0.0.1.

Each repetition restarts the run from whatever the previous kill left (resuming from the newest
good checkpoint, without save_overwrite), lets it save and delete for a random while, and kills
it. After every kill every checkpoint the finders report must pass a deep verify and load
exactly the values saved for its step; the last run must finish every step. The seed is fixed;
the kill moments still fall differently on each machine, which is the point: every run samples
new interleavings. Killing the GCS server itself: `test_fault_server_gcs.py`.
"""

from __future__ import annotations

import random
import signal
import time
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event

import pytest
from support.crash_worker import (
    JOIN_TIMEOUT,
    KEEP,
    Launcher,
    check_checkpoints,
    finish,
    start_on_gcs,
    start_on_s3,
    tmp_folders,
)

pytestmark = pytest.mark.slow

# Per back end: (seed, repetitions, steps per run). A gs:// run takes longer, so it has fewer.
CASES = {"local": (20261121, 20, 4), "gcs": (4242, 8, 3), "s3": (5353, 4, 3)}


@pytest.mark.parametrize("backend", list(CASES))
def test_random_kills_never_leave_a_bad_checkpoint(
    launcher: Launcher, backend: str, request: pytest.FixtureRequest, tmp_path
) -> None:
    seed, repetitions, steps_per_run = CASES[backend]
    rng = random.Random(seed)
    if backend == "gcs":
        emulator = request.getfixturevalue("gcs_server").url
        folder = f"{request.getfixturevalue('gcs_bucket')}/run"

        def start(last: int, mode: str) -> tuple[BaseProcess, Event]:
            return start_on_gcs(launcher, tmp_path, folder, emulator, last, mode)

    elif backend == "s3":
        endpoint = request.getfixturevalue("s3_server").url
        folder = f"{request.getfixturevalue('s3_bucket')}/run"

        def start(last: int, mode: str) -> tuple[BaseProcess, Event]:
            return start_on_s3(launcher, tmp_path, folder, endpoint, last, mode)

    else:
        folder, work = str(tmp_path / "run"), str(tmp_path / "work")

        def start(last: int, mode: str) -> tuple[BaseProcess, Event]:
            return launcher.start(folder, work, last, mode)

    # One undisturbed run: how long its saves take here, to spread kills over.
    proc, ready = start(steps_per_run, "sync")
    assert ready.wait(JOIN_TIMEOUT), "the run never got ready"
    began = time.monotonic()
    assert finish(proc) == 0
    span = time.monotonic() - began
    last = steps_per_run

    killed = 0
    previous = KEEP  # checkpoints the last check found
    for rep in range(repetitions):
        mode = rng.choice(["sync", "async"])
        last += steps_per_run  # every run has new steps to save
        delay = rng.uniform(0.0, span)
        proc, ready = start(last, mode)
        assert ready.wait(JOIN_TIMEOUT), "the run never got ready"
        began = time.monotonic()
        proc.join(delay)  # wakes early if the run ends; otherwise the kill comes at `delay`
        if proc.is_alive():
            proc.kill()  # SIGKILL
            killed += 1
        else:  # the machine got faster: aim the next kills at the shorter runs
            span = (span + time.monotonic() - began) / 2
        code = finish(proc)
        why = f"repetition {rep} ({mode}, kill after {delay:.3f}s)"
        assert code in (0, -signal.SIGKILL), f"{why}: the run failed with exit code {code}"
        found = check_checkpoints(folder, tmp_path / "check")
        if code == 0:  # a run that finished deleted every step retention does not keep
            assert len(found) == KEEP, f"{why}: {found}"
        else:  # a kill between a commit and its deletions leaves one more than the last check
            assert len(found) <= max(previous, KEEP) + 1, f"{why}: {found}"
        previous = len(found)

    # Most repetitions must have been cut short, or the test proved little.
    assert killed >= repetitions // 4, f"only {killed} of {repetitions} runs were killed"

    proc, _ready = start(last + 2, "async")
    assert finish(proc) == 0
    assert check_checkpoints(folder, tmp_path / "check") == [last + 1, last + 2]
    if backend == "local":  # a local save writes into `stepN-tmp` first
        assert not list(tmp_folders(tmp_path / "run"))
