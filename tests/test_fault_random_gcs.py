"""Crash safety on gs:// at random moments: SIGKILL runs saving to a real fake-gcs-server on
127.0.0.1 many times, and SIGKILL the server itself in the middle of runs. After every kill, each
checkpoint the finders report passes a deep verify and loads exactly the values saved for its
step; the restarted run completes every step.
"""

from __future__ import annotations

import random
import signal
import time
from collections.abc import Iterator

import pytest
from crash_worker import (
    JOIN_TIMEOUT,
    KEEP,
    Launcher,
    check_checkpoints,
    finish,
    start_on_gcs,
)
from servers import FakeGCS, use_emulator

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def launcher() -> Iterator[Launcher]:
    yield Launcher.create()


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
        proc.join(delay)
        if proc.is_alive():
            proc.kill()
            killed += 1
        code = finish(proc)
        why = f"repetition {rep} ({mode}, kill after {delay:.3f}s)"
        assert code in (0, -signal.SIGKILL), f"{why}: the run failed with exit code {code}"
        found = check_checkpoints(url, tmp_path / "check")
        assert len(found) <= KEEP + 1, f"{why}: {found}"
    assert killed >= 4, f"only {killed} of 8 runs were killed"

    proc, _ = start_on_gcs(launcher, tmp_path, url, gcs_server.url, last + 2, "async")
    assert finish(proc) == 0
    assert check_checkpoints(url, tmp_path / "check") == [last + 1, last + 2]


def test_gcs_server_killed_mid_run_then_restarted(launcher, gcs_server, tmp_path):
    """The server dies under a running save: the run fails within its retry deadline with an
    error (it neither hangs nor reports a torn checkpoint); with the server back (same disk),
    every reported checkpoint is exact and a restarted run completes."""
    rng = random.Random(7)
    root = tmp_path / "objects"
    server = FakeGCS(tmp_path, root=root).start()
    use_emulator(server.url)
    try:
        url = f"gs://{server.create_bucket()}/run"
        # keep=None: no deletions, so every commit of every run stays to be checked
        kw = {"retry_deadline": 3.0, "keep": None}
        proc, ready = start_on_gcs(launcher, tmp_path, url, server.url, 2, "sync", **kw)
        assert ready.wait(JOIN_TIMEOUT)
        began = time.monotonic()
        assert finish(proc) == 0
        span = time.monotonic() - began

        last, failed = 2, 0
        for rep in range(4):
            mode = ["sync", "async"][rep % 2]
            last += 2
            proc, ready = start_on_gcs(launcher, tmp_path, url, server.url, last, mode, **kw)
            assert ready.wait(JOIN_TIMEOUT)
            proc.join(rng.uniform(0.05, 0.9) * span)
            server.kill()  # SIGKILL the storage server, whatever the run is doing
            code = finish(proc)
            assert code in (0, 1), f"repetition {rep}: exit code {code}"
            failed += code == 1
            server = FakeGCS(tmp_path, root=root, port=server.port).start()
            found = check_checkpoints(url, tmp_path / "check")
            assert found == list(range(1, found[-1] + 1)) if found else True
        assert failed >= 2, f"only {failed} of 4 runs were hit by the server's death"

        proc, _ = start_on_gcs(launcher, tmp_path, url, server.url, last + 1, "async", **kw)
        assert finish(proc) == 0
        assert check_checkpoints(url, tmp_path / "check") == list(range(1, last + 2))
    finally:
        server.stop()
        use_emulator(gcs_server.url)
