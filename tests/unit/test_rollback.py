"""Rolling a run back (docs/design.md §11): a run that starts from an older step than the newest
abandons the newer checkpoints; no finder reports them again, and the run's own saves of those
steps are written, replacing them. With `CheckpointManager` directly, on a local folder and on
an object store."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from support.models import make_module

from trainckpt import Checkpointer, CheckpointManager, CheckpointPolicy, ModelAndOptim

ABANDONED_FILE = ".abandoned.json"  # layout.ABANDONED_FILE (spelled out: part of the format)
METADATA_FILE = ".metadata.json"


def _first_run(ckpt: Checkpointer, folder: str, last: int, policy: CheckpointPolicy) -> None:
    """Steps 0..last of a first trajectory, every trainer state marked "old"."""
    module = make_module(steps=1)
    driver = CheckpointManager(ckpt, policy, folder)
    for step in range(last + 1):
        driver.maybe_save(step, module, {"step": step, "trajectory": "old"})
    driver.finish()


def _trajectory(ckpt: Checkpointer, path: str) -> str:
    state = ckpt.load(path, make_module(steps=1))
    assert state is not None
    return str(state["trajectory"])


def _steps(folder: str) -> list[int]:
    return [s for s, _ in Checkpointer.find_checkpoints(folder)]


def test_resume_from_an_older_step_writes_the_new_trajectory_over_the_abandoned_one(
    ckpt: Checkpointer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = str(tmp_path / "ckpts")
    policy = CheckpointPolicy(save_interval=2)
    _first_run(ckpt, folder, 6, policy)
    assert _steps(folder) == [0, 2, 4, 6]

    # The user loads step 2 themselves (a bad newest checkpoint, a loss spike): the first step
    # they report is 3, the step after the one they resumed from.
    module = make_module(steps=1)
    ckpt.load(f"{folder}/step2", module)
    driver = CheckpointManager(ckpt, policy, folder)
    with caplog.at_level(logging.WARNING):
        assert driver.maybe_save(2, module, {"step": 2, "trajectory": "new"}) == f"{folder}/step2"
    assert "[4, 6]" in caplog.text and "abandoned" in caplog.text
    # Between the resume and the new saves, a crash must resume from step 2, not step 6.
    assert Checkpointer.latest_checkpoint(folder) == f"{folder}/step2"
    assert ckpt.find_latest_good(folder) == f"{folder}/step2"
    assert _steps(folder) == [0, 2]
    assert (tmp_path / "ckpts" / "step6" / ABANDONED_FILE).exists()  # kept until replaced

    for step in range(3, 5):
        driver.maybe_save(step, module, {"step": step, "trajectory": "new"})
    # The final save of a step whose number the abandoned trajectory used is written too.
    driver.save(6, module, {"step": 6, "trajectory": "new"})
    driver.finish()
    assert _steps(folder) == [0, 2, 4, 6]
    assert [_trajectory(ckpt, f"{folder}/step{s}") for s in (2, 4, 6)] == ["old", "new", "new"]
    assert not list((tmp_path / "ckpts").glob("*-replaced"))
    assert not list((tmp_path / "ckpts").glob(f"*/{ABANDONED_FILE}"))


def test_resume_skipping_a_damaged_newest_abandons_it_and_retention_counts_the_new_ones(
    ckpt: Checkpointer, tmp_path: Path
) -> None:
    folder = str(tmp_path / "ckpts")
    policy = CheckpointPolicy(save_interval=2, max_checkpoints=2, remove="all_non_permanent")
    _first_run(ckpt, folder, 8, policy)
    assert _steps(folder) == [0, 6, 8]
    shard = next((tmp_path / "ckpts" / "step8" / "model_and_optim").glob("*.distcp"))
    # Truncated, as a torn write leaves it: a new file (in place would also damage step 6,
    # which links the same file: incremental saves share unchanged files).
    data = shard.read_bytes()
    shard.unlink()
    shard.write_bytes(data[:-1])  # resume skips step 8

    module = make_module(steps=1)
    driver = CheckpointManager(ckpt, policy, folder)
    resumed = driver.resume(module)
    assert resumed is not None and resumed[0] == 6
    assert Checkpointer.latest_checkpoint(folder) == f"{folder}/step6"
    for step in range(7, 13):
        driver.maybe_save(step, module, {"step": step, "trajectory": "new"})
    driver.finish()
    # Step 8 was written again (new), then trimmed with the other new ones: the two newest
    # permanent checkpoints, counted from the new trajectory.
    assert _steps(folder) == [0, 10, 12]
    assert _trajectory(ckpt, f"{folder}/step12") == "new"
    assert sorted(p.name for p in (tmp_path / "ckpts").iterdir()) == ["step0", "step10", "step12"]


def test_loading_an_older_step_mid_run_rolls_back_again(ckpt: Checkpointer, tmp_path: Path) -> None:
    folder = str(tmp_path / "ckpts")
    module = make_module(steps=1)
    driver = CheckpointManager(ckpt, CheckpointPolicy(save_interval=2), folder)
    for step in range(5):
        driver.maybe_save(step, module, {"step": step, "trajectory": "old"})
    ckpt.load(f"{folder}/step2", module)
    assert driver.start_from(2) == [4]
    driver.maybe_save(4, module, {"step": 4, "trajectory": "new"})  # written, not skipped
    driver.finish()
    assert _steps(folder) == [0, 2, 4] and _trajectory(ckpt, f"{folder}/step4") == "new"


def test_undoing_an_abandonment_by_hand(ckpt: Checkpointer, tmp_path: Path) -> None:
    """The abandoned folder keeps its commit record as `.abandoned.json`: renaming it back
    makes it a checkpoint again, as the warning says."""
    folder = tmp_path / "ckpts"
    _first_run(ckpt, str(folder), 4, CheckpointPolicy(save_interval=2))
    driver = CheckpointManager(ckpt, CheckpointPolicy(save_interval=2), folder)
    driver.start_from(2)
    driver.finish()
    (folder / "step4" / ABANDONED_FILE).rename(folder / "step4" / METADATA_FILE)
    assert Checkpointer.verify(folder / "step4", deep=True).ok
    assert _trajectory(ckpt, str(folder / "step4")) == "old"


def test_plain_checkpointer_abandons_at_the_first_save_after_loading_an_older_step(
    ckpt: Checkpointer, tmp_path: Path
) -> None:
    """What OLMo-core's Trainer does through trainckpt's `Checkpointer`: load an older step
    of the save folder, then save there. Loading another folder's checkpoint abandons
    nothing."""
    folder = str(tmp_path / "ckpts")
    _first_run(ckpt, folder, 6, CheckpointPolicy(save_interval=2))
    other = str(tmp_path / "other")
    _first_run(ckpt, other, 4, CheckpointPolicy(save_interval=2))
    module: ModelAndOptim = make_module(steps=1)
    ckpt.load(f"{other}/step2", module)
    ckpt.save(f"{folder}/step7", module, {"step": 7, "trajectory": "branch"})
    assert _steps(folder) == [0, 2, 4, 6, 7]  # a checkpoint of another folder: no rollback
    assert _steps(other) == [0, 2, 4]

    ckpt.load(f"{folder}/step2", module)
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(1)
    ckpt.save(f"{folder}/step4", module, {"step": 4, "trajectory": "new"})
    assert _steps(folder) == [0, 2, 4]
    assert _trajectory(ckpt, f"{folder}/step4") == "new"


def test_resume_into_abandons_at_load_time_and_only_in_the_folder_loaded_from(
    ckpt: Checkpointer, tmp_path: Path
) -> None:
    """`Checkpointer.resume_into` closes the window between a load and the first save; a
    load for evaluation (no `resume_into`, no save) abandons nothing."""
    folder, other = str(tmp_path / "ckpts"), str(tmp_path / "other")
    _first_run(ckpt, folder, 6, CheckpointPolicy(save_interval=2))
    _first_run(ckpt, other, 4, CheckpointPolicy(save_interval=2))
    module = make_module(steps=1)
    ckpt.load(f"{folder}/step2", module)  # evaluation: nothing happens
    assert Checkpointer.latest_checkpoint(folder) == f"{folder}/step6"
    ckpt.load(f"{other}/step2", module)
    assert ckpt.resume_into(folder) == []  # another folder's checkpoint: no rollback
    assert _steps(other) == [0, 2, 4] and _steps(folder) == [0, 2, 4, 6]

    ckpt.load(f"{folder}/step2", module)
    assert ckpt.resume_into(folder) == [4, 6]
    assert Checkpointer.latest_checkpoint(folder) == f"{folder}/step2"  # before any save
    assert ckpt.resume_into(folder) == []  # once per load


def test_on_rollback_refuse_names_the_newer_steps_and_changes_nothing(tmp_path: Path) -> None:
    from trainckpt import CheckpointerConfig
    from trainckpt.errors import ConfigurationError

    folder = str(tmp_path / "ckpts")
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", on_rollback="refuse").build()
    try:
        _first_run(ckpt, folder, 6, CheckpointPolicy(save_interval=2))
        module = make_module(steps=1)
        driver = CheckpointManager(ckpt, CheckpointPolicy(save_interval=2), folder)
        with pytest.raises(ConfigurationError, match=r"\[4, 6\].*on_rollback='replace'"):
            driver.start_from(2)
        ckpt.load(f"{folder}/step4", module)
        with pytest.raises(ConfigurationError, match=r"step 4.*\[6\]"):
            ckpt.resume_into(folder)
        assert _steps(folder) == [0, 2, 4, 6]
        assert not list((tmp_path / "ckpts").glob(f"*/{ABANDONED_FILE}"))
        assert driver.start_from(6) == []  # resuming from the newest is no rollback
    finally:
        ckpt.close()


def test_rollback_on_an_object_store(tmp_path: Path, gcs_bucket: str) -> None:
    from trainckpt import CheckpointerConfig

    folder = f"{gcs_bucket}/rollback"
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    try:
        _first_run(ckpt, folder, 4, CheckpointPolicy(save_interval=2))
        module = make_module(steps=1)
        driver = CheckpointManager(ckpt, CheckpointPolicy(save_interval=2), folder)
        assert driver.start_from(2) == [4]
        assert Checkpointer.latest_checkpoint(folder) == f"{folder}/step2"
        driver.maybe_save(3, module, {"step": 3, "trajectory": "new"})
        driver.maybe_save(4, module, {"step": 4, "trajectory": "new"})
        driver.finish()
        assert _steps(folder) == [0, 2, 4]
        assert Checkpointer.verify(f"{folder}/step4", deep=True).ok
        assert _trajectory(ckpt, f"{folder}/step4") == "new"
    finally:
        ckpt.close()


def test_object_store_copy_aside_outlives_a_failed_replacement_and_prune_clears_it(
    tmp_path: Path, s3_bucket: str
) -> None:
    """A save that fails once the abandoned step is copied aside leaves `step4-replaced/`
    whole: no finder reports it, `ls` shows it as a working folder, a deletion waits while a
    save holds the step's claim, and prune removes it afterwards."""
    from trainckpt import CheckpointerConfig
    from trainckpt.core import claim as claims
    from trainckpt.core.commit import delete_leftover
    from trainckpt.format.folder_scan import scan_folder
    from trainckpt.retention.prune import apply_prune, plan_prune
    from trainckpt.storage import resolve
    from trainckpt.testing.faults import on_fault_point

    folder = f"{s3_bucket}/rollback"
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", claim_lease=1.0).build()
    try:
        _first_run(ckpt, folder, 4, CheckpointPolicy(save_interval=2))
        module = make_module(steps=1)
        driver = CheckpointManager(ckpt, CheckpointPolicy(save_interval=2), folder)
        assert driver.start_from(2) == [4]

        def fail() -> None:
            raise RuntimeError("interrupted after the copy aside")

        with on_fault_point("replacing", fail), pytest.raises(RuntimeError, match="copy aside"):
            driver.save(4, module, {"step": 4, "trajectory": "new"})
        driver.finish()
    finally:
        ckpt.close()
    storage, root = resolve(folder)
    aside = f"{root}/step4-replaced"
    assert ABANDONED_FILE in storage.list_files(aside)
    assert _steps(folder) == [0, 2]
    entry = next(e for e in scan_folder(storage, root) if e.name == "step4-replaced")
    assert entry.state == "tmp" and "set aside" in entry.note

    # A save of step 4 holds its claim: the deletion of the copy aside leaves it alone.
    live = claims.acquire(storage, f"{root}/step4", lease=1.0)
    live.start_renewing()
    try:
        assert not delete_leftover(storage, aside)
    finally:
        live.release()
    assert ABANDONED_FILE in storage.list_files(aside)

    plan = plan_prune(root, scan_folder(storage, root), keep_last=2, keep_ephemeral=False)
    assert aside in [e.path for e in plan.to_delete]
    apply_prune(plan, on_deleted=lambda e: None)
    assert storage.list_files(aside) == {}
    assert _steps(folder) == [0, 2]
