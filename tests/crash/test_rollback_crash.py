"""SIGKILL a rolled-back run while its save replaces a checkpoint of the abandoned trajectory
(docs/design.md §11): at every point the old folder or the new checkpoint of that step exists whole,
no finder reports the abandoned one, and a restarted run finishes the replacement."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from support.crash_worker import Launcher, check_checkpoints, finish, rollback_run
from support.crash_worker import run as plain_run

from trainckpt import Checkpointer, CheckpointerConfig
from trainckpt.format.records import CheckpointManifest
from trainckpt.format.verify import check_crcs
from trainckpt.storage import resolve

pytestmark = pytest.mark.slow


def _whole(folder: Path) -> bool:
    """Every file `folder`'s manifest lists is there with its CRC32C (commit record or not)."""
    manifest = CheckpointManifest.model_validate(
        json.loads((folder / ".manifest.json").read_text())
    )
    storage, path = resolve(str(folder))
    return not check_crcs(storage, path, sorted(manifest.files.items()))


def _trajectory(folder: Path, work: Path) -> str:
    from support.crash_worker import new_module

    ckpt = CheckpointerConfig(work_dir=work).build()
    try:
        state = ckpt.load(str(folder), new_module())
    finally:
        ckpt.close()
    assert state is not None
    return str(state.get("trajectory", "old"))


@pytest.mark.parametrize("point", ["replacing", "after-rename"])
def test_kill_while_replacing_an_abandoned_step(launcher: Launcher, tmp_path: Path, point: str):
    folder, work = tmp_path / "run", tmp_path / "work"
    proc, _ = launcher.start(str(folder), str(work), 3, "sync", keep=None, target=plain_run)
    assert finish(proc) == 0
    assert check_checkpoints(folder) == [1, 2, 3]

    # Roll back to step 1 and get killed while the save of step 2 replaces the old step 2.
    proc, _ = launcher.start(
        str(folder), str(work), 1, 3, fault=point, fault_step=2, target=rollback_run
    )
    assert finish(proc) == -signal.SIGKILL, f"the fault point '{point}' was not reached"
    step2, tmp, aside = folder / "step2", folder / "step2-tmp", folder / "step2-replaced"
    found = [s for s, _ in Checkpointer.find_checkpoints(folder)]
    if point == "after-rename":  # the new one is committed; the old one is still aside
        assert found == [1, 2] and _trajectory(step2, work) == "new"
        assert aside.is_dir()
    else:  # the old one (abandoned, never reported) and the complete new one both exist
        assert found == [1]  # never the abandoned step 3, nor step 2 of either trajectory
        assert (aside / ".abandoned.json").exists() and _whole(aside)
        assert (tmp / ".metadata.json").exists() and _whole(tmp)
    assert (folder / "step3" / ".abandoned.json").exists()

    # A restarted run resumes from what the finders report and saves steps 2 and 3 anew.
    resume = max(found)
    proc, _ = launcher.start(str(folder), str(work), resume, 3, target=rollback_run)
    assert finish(proc) == 0
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [1, 2, 3]
    assert [_trajectory(folder / f"step{s}", work) for s in (1, 2, 3)] == ["old", "new", "new"]
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == ["step1", "step2", "step3"]
