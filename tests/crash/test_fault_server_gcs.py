"""SIGKILL the fake-gcs-server (a real process on 127.0.0.1, objects on disk) in the middle of
training runs that save to it. A run must then fail within its retry deadline (neither hang nor
commit a torn checkpoint); with the server restarted on the same disk, every checkpoint the
finders report loads exactly, and a restarted run completes every step.
"""

from __future__ import annotations

import random
import time

import pytest
from support.crash_worker import (
    JOIN_TIMEOUT,
    check_checkpoints,
    finish,
    read_outcome,
    run_recorded,
    start_on_gcs,
)
from support.servers import FakeGCS, use_emulator

pytestmark = pytest.mark.slow


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
            outcome = tmp_path / f"outcome-{rep}.json"
            proc, ready = start_on_gcs(
                launcher, tmp_path, url, server.url, last, mode,
                target=run_recorded, outcome=str(outcome), **kw,
            )  # fmt: skip
            assert ready.wait(JOIN_TIMEOUT)
            proc.join(rng.uniform(0.05, 0.6) * span)
            server.kill()  # SIGKILL the storage server, whatever the run is doing
            code = finish(proc)
            chain = read_outcome(outcome)
            assert (code, chain) == (0, None) or code == 1, f"repetition {rep}: {code}, {chain}"
            if code == 1:
                _assert_hit_by_the_server_death(chain, rep)
                failed += 1
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


def _assert_hit_by_the_server_death(chain: list[dict] | None, rep: int) -> None:
    """The run ended with a trainckpt error (not a failed assertion or another bug in the
    worker) that comes from requests to the dead server failing past the retry deadline."""
    assert chain, f"repetition {rep} exited with code 1 but recorded no exception"
    assert chain[0]["checkpoint_error"], f"repetition {rep} failed with {chain[0]}"
    text = " ".join(f"{e['type']}: {e['message']}" for e in chain)
    assert "retry_deadline=3s" in text or "Connection refused" in text, chain
