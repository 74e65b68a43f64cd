"""Crash safety on s3:// (moto on 127.0.0.1): SIGKILL the training run at named points of the
object-store commit with async saves (a sync kill before the commit record is in
`backends/test_s3_checkpointer.py`), during a deletion, and let the server stop answering under
a running save. After each, every checkpoint the finders report passes a deep verify and loads
exactly the values saved for its step, and a restarted run completes every step. Random kills
on s3://: `test_fault_random.py`.
"""

from __future__ import annotations

import signal
import time

import pytest
from support.crash_worker import (
    JOIN_TIMEOUT,
    check_checkpoints,
    finish,
    read_outcome,
    run_recorded,
    start_on_s3,
)
from support.s3_server import S3Proxy

from trainckpt.storage import storage_for

pytestmark = pytest.mark.slow


def _step_prefixes(url: str) -> list[str]:
    return storage_for(url).list_dir(url).dirs


@pytest.mark.parametrize(
    ("point", "mode"),
    [("after-shards", "async"), ("before-commit-record", "async"), ("during-delete", "sync")],
)
def test_s3_kill_at_named_point_then_restart(launcher, s3_server, s3_bucket, tmp_path, point, mode):
    url = f"{s3_bucket}/run"
    fault = {"fault": point, "fault_step": 3}
    proc, _ = start_on_s3(launcher, tmp_path, url, s3_server.url, 4, mode, **fault)
    code = finish(proc)
    assert code == -signal.SIGKILL, f"exit code {code}: the fault point '{point}' was not reached"

    found = check_checkpoints(url, tmp_path / "check")
    if point == "during-delete":
        # step 1's commit record is gone, its data not: not a checkpoint any more
        assert found == [2, 3]
        assert "step1" in _step_prefixes(url)
    else:
        assert found == [1, 2]

    proc, _ = start_on_s3(launcher, tmp_path, url, s3_server.url, 5, mode)
    assert finish(proc) == 0
    assert check_checkpoints(url, tmp_path / "check") == [4, 5]
    leftovers = [p for p in _step_prefixes(url) if p not in ("step4", "step5")]
    assert leftovers in ([], ["step1"]), leftovers  # an uncommitted step 1 is retention's job


def test_s3_server_stops_answering_under_async_saves(
    launcher, s3_bucket, s3_proxy: S3Proxy, tmp_path
):
    """Every request to the server fails (connections dropped unanswered) from a moment in the
    middle of the run's saves: the run fails with a trainckpt error after its retry deadline
    (not a hang, not a failed assertion); with the server answering again, every reported
    checkpoint is exact and a restarted run completes."""
    url = f"{s3_bucket}/run"
    kw = {"retry_deadline": 3.0, "keep": None}
    proc, ready = start_on_s3(launcher, tmp_path, url, s3_proxy.url, 2, "sync", **kw)
    assert ready.wait(JOIN_TIMEOUT)
    assert finish(proc) == 0
    uploads_per_run = len(s3_proxy.ops("PutObject"))

    outcome = tmp_path / "outcome.json"
    proc, ready = start_on_s3(
        launcher, tmp_path, url, s3_proxy.url, 6, "async",
        target=run_recorded, outcome=str(outcome), **kw,
    )  # fmt: skip
    assert ready.wait(JOIN_TIMEOUT)
    # The server dies once the run has uploaded about half a run's worth of objects.
    deadline = time.monotonic() + JOIN_TIMEOUT
    while len(s3_proxy.ops("PutObject")) < uploads_per_run * 3 // 2 and proc.is_alive():
        assert time.monotonic() < deadline, "the run uploaded nothing"
        time.sleep(0.005)  # watching a counter, not timing anything
    s3_proxy.fail(lambda r: True, 0, "dropped", times=10**9)
    code = finish(proc)
    chain = read_outcome(outcome)
    assert code == 1, f"the run must fail once the server is gone: exit code {code}, {chain}"
    assert chain and chain[0]["checkpoint_error"], chain
    text = " ".join(f"{e['type']}: {e['message']}" for e in chain)
    assert "retry_deadline" in text or "Connection" in text, chain

    with s3_proxy.lock:
        s3_proxy.faults.clear()  # the server answers again
    found = check_checkpoints(url, tmp_path / "check")
    assert found == list(range(1, found[-1] + 1)) and found[-1] < 6, found
    proc, _ = start_on_s3(launcher, tmp_path, url, s3_proxy.url, 7, "async", **kw)
    assert finish(proc) == 0
    assert check_checkpoints(url, tmp_path / "check") == list(range(1, 8))
