"""SIGKILL a training run at each named point of a save that links the files of its frozen
layer from the previous checkpoint (docs/incremental.md), then restart it. Every checkpoint the
finders report passes a deep verify and loads exactly the values saved for its step, whatever
the kill left behind and whatever retention deleted meanwhile (the run keeps two)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from support.crash_worker import FROZEN_ENV, Launcher, check_checkpoints, finish, tmp_folders

from trainckpt.testing.faults import INCREMENTAL_POINTS, POINTS

pytestmark = pytest.mark.slow

ENV = {FROZEN_ENV: "1"}


def _run(launcher: Launcher, folder: Path, last_step: int, **fault: object) -> int:
    work = str(folder.parent / "work")
    proc, _ready = launcher.start(str(folder), work, last_step, "sync", env=ENV, **fault)
    return finish(proc)


def _linked(a: Path, b: Path) -> bool:
    """True when checkpoints `a` and `b` share a shard file (a hard link)."""
    inodes = {p.stat().st_ino for p in (a / "model_and_optim").glob("*.distcp")}
    return any(p.stat().st_ino in inodes for p in (b / "model_and_optim").glob("*.distcp"))


@pytest.mark.parametrize("point", [*POINTS, *INCREMENTAL_POINTS])
def test_kill_during_a_save_that_links_then_restart(launcher, tmp_path, monkeypatch, point):
    monkeypatch.setenv(FROZEN_ENV, "1")  # `reference` in this process: the same frozen layer
    folder = tmp_path / "run"
    code = _run(launcher, folder, 4, fault=point, fault_step=3)
    assert code == -signal.SIGKILL, f"exit code {code}: the fault point '{point}' was not reached"

    found = check_checkpoints(folder)
    step3_committed = point in ("after-rename", "during-delete")
    expected = ([] if point == "during-delete" else [1]) + [2] + ([3] if step3_committed else [])
    assert found == expected
    if point != "during-delete":
        assert _linked(folder / "step1", folder / "step2")
    # what the kill left (`-tmp` with links into step2) never changes step2
    assert os.path.isdir(folder / "step2")

    # The restarted run saves 4 in full (no record of a save yet), then 5 links from 4.
    assert _run(launcher, folder, 5) == 0
    assert check_checkpoints(folder) == [4, 5]
    assert _linked(folder / "step4", folder / "step5")
    assert not list(tmp_folders(folder))


@pytest.mark.parametrize("point", ["reused-file", "before-commit-record"])
def test_gcs_kill_during_a_save_that_copies_then_restart(
    launcher, gcs_server, gcs_bucket, tmp_path, monkeypatch, point
):
    """On gs://: killed after the first server-side copy, or with every file copied or
    uploaded and the manifest written; the restarted run clears the step and finishes."""
    monkeypatch.setenv(FROZEN_ENV, "1")
    url = f"{gcs_bucket}/run"
    env = {**ENV, "STORAGE_EMULATOR_HOST": gcs_server.url, "NO_GCE_CHECK": "true"}
    work = str(tmp_path / "work")

    def start(last: int, **fault: object) -> int:
        proc, _ = launcher.start(
            str(tmp_path / "unused"), work, last, "sync", url=url, env=env, **fault
        )
        return finish(proc)

    assert start(4, fault=point, fault_step=3) == -signal.SIGKILL
    assert check_checkpoints(url, tmp_path / "check") == [1, 2]
    assert start(5) == 0
    assert check_checkpoints(url, tmp_path / "check") == [4, 5]
