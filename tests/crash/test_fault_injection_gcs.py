"""Crash safety on gs:// (a real fake-gcs-server on 127.0.0.1): SIGKILL the training run at each
named point of the object-store commit, sync and async. After every kill, each checkpoint the
finders report passes a deep verify and loads exactly the values saved for its step; the
restarted run, without save_overwrite, completes every step. Random kills: `test_fault_random.py`;
killing the server itself: `test_fault_server_gcs.py`.
"""

from __future__ import annotations

import signal

import pytest
from support.crash_worker import check_checkpoints, finish, start_on_gcs

from trainckpt.storage import storage_for
from trainckpt.testing.faults import POINTS

pytestmark = pytest.mark.slow

OBJECT_STORE_POINTS = [p for p in POINTS if p not in ("before-rename", "after-rename")]


def _step_prefixes(url: str) -> list[str]:
    return storage_for(url).list_dir(url).dirs


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", OBJECT_STORE_POINTS)
def test_gcs_kill_at_named_point_then_restart(
    launcher, gcs_server, gcs_bucket, tmp_path, point, mode
):
    url = f"{gcs_bucket}/run"
    fault = {"fault": point, "fault_step": 3}
    proc, _ = start_on_gcs(launcher, tmp_path, url, gcs_server.url, 4, mode, **fault)
    code = finish(proc)
    assert code == -signal.SIGKILL, f"exit code {code}: the fault point '{point}' was not reached"

    found = check_checkpoints(url, tmp_path / "check")
    if point == "during-delete":
        # step 1's commit record is gone, its data not: not a checkpoint any more
        assert found in ([2, 3], [2, 3, 4])  # async: step 4 may commit before the kill
        assert "step1" in _step_prefixes(url)
    else:
        assert found == [1, 2]

    proc, _ = start_on_gcs(launcher, tmp_path, url, gcs_server.url, 5, mode)
    assert finish(proc) == 0
    assert check_checkpoints(url, tmp_path / "check") == [4, 5]
    # the killed save's objects were cleared by the restarted save of that step
    leftovers = [p for p in _step_prefixes(url) if p not in ("step4", "step5")]
    assert leftovers in ([], ["step1"]), leftovers  # an uncommitted step 1 is retention's job
