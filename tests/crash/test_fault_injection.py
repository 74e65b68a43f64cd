"""SIGKILL a real training process at each named point of the commit protocol, sync and async.

After every kill: each checkpoint the finders report passes a deep verify and loads exactly the
values saved for its step (`crash_worker.reference`); a run restarted without save_overwrite
completes every remaining step, and its checkpoints hold what an uninterrupted run would have.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.crash_worker import Launcher, check_checkpoints, finish, tmp_folders

from trainckpt.testing.faults import POINTS

pytestmark = pytest.mark.slow


def _run(launcher: Launcher, folder: Path, last_step: int, mode: str, **fault: object) -> int:
    work = str(folder.parent / "work")
    proc, _ready = launcher.start(str(folder), work, last_step, mode, **fault)
    return finish(proc)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("point", POINTS)
def test_kill_at_named_point_then_restart(launcher, tmp_path, point, mode):
    folder = tmp_path / "run"
    code = _run(launcher, folder, 4, mode, fault=point, fault_step=3)
    assert code == -signal.SIGKILL, f"exit code {code}: the fault point '{point}' was not reached"

    # Killed during step 3's save (or, for during-delete, while deleting step 1 after it).
    found = check_checkpoints(folder)
    step3_committed = point in ("after-rename", "during-delete")
    expected = ([] if point == "during-delete" else [1]) + [2] + ([3] if step3_committed else [])
    if point == "during-delete" and mode == "async":
        # the delete runs on the training thread while step 4 saves in the background; that
        # save may commit before the kill
        assert found in (expected, [*expected, 4])
    else:
        assert found == expected

    # Restart without save_overwrite: it resumes from the newest good checkpoint, redoes the
    # lost steps over whatever the kill left behind, and finishes.
    assert _run(launcher, folder, 5, mode) == 0
    assert check_checkpoints(folder) == [4, 5]
    assert not list(tmp_folders(folder))


def test_kill_between_saves_leaves_every_reported_checkpoint_good(launcher, tmp_path):
    """A kill right after a delete removed a commit record leaves an uncommitted folder that the
    finders skip and the next save of that step clears."""
    folder = tmp_path / "run"
    assert _run(launcher, folder, 3, "sync") == 0
    assert check_checkpoints(folder) == [2, 3]
    code = _run(launcher, folder, 5, "sync", fault="during-delete", fault_step=4)
    assert code == -signal.SIGKILL
    assert check_checkpoints(folder) == [3, 4]
    assert (folder / "step2").is_dir() and not (folder / "step2" / ".metadata.json").exists()
    assert _run(launcher, folder, 5, "sync") == 0
    assert check_checkpoints(folder) == [4, 5]
