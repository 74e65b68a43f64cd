"""`CheckpointManager`, the per-step driver: saves and deletions on real folders, real failures."""

from __future__ import annotations

import logging
import resource
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.models import make_module
from support.multiproc import run_ranks

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointPolicy,
    ModelAndOptim,
)


@pytest.fixture
def checkpointer(tmp_path: Path) -> Iterator[Checkpointer]:
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    yield ckpt
    try:
        ckpt.close()
    except CheckpointError:
        pass  # a test that made a save fail has already checked its error


def run(
    checkpointer: Checkpointer,
    folder: Path,
    policy: CheckpointPolicy,
    steps: range,
    module: ModelAndOptim | None = None,
) -> CheckpointManager:
    """A training loop's calls: maybe_save after each step, then finish."""
    module = module or make_module(steps=1)
    driver = CheckpointManager(checkpointer, policy, folder)
    for step in steps:
        if step > 0:
            with torch.no_grad():  # a "training step" that changes every parameter
                for p in module.model.parameters():
                    p.add_(0.01)
        driver.maybe_save(step, module, lambda s=step: {"step": s})
    driver.finish()
    return driver


def kinds(folder: Path) -> dict[int, str]:
    """Committed checkpoints in `folder`, by step, with the kind their metadata records."""
    return {
        step: "eph" if Checkpointer.read_metadata(path).ephemeral else "perm"
        for step, path in Checkpointer.find_checkpoints(folder)
    }


def test_one_run_keeps_permanent_and_drops_superseded_ephemeral(
    checkpointer: Checkpointer, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpts"
    policy = CheckpointPolicy(save_interval=10, ephemeral_save_interval=5)
    run(checkpointer, folder, policy, range(0, 28))
    assert kinds(folder) == {0: "perm", 10: "perm", 20: "perm", 25: "eph"}
    assert sorted(p.name for p in folder.iterdir()) == ["step0", "step10", "step20", "step25"]
    state = checkpointer.load(folder / "step25", make_module(seed=3, steps=0))
    assert state == {"step": 25}


def test_finish_waits_for_the_deletions_the_last_async_commit_allows(
    checkpointer: Checkpointer, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpts"
    for _ in range(3):  # the last save is async and its commit deletes step 2: every time
        run(checkpointer, folder, CheckpointPolicy(ephemeral_save_interval=2), range(1, 5))
        assert kinds(folder) == {4: "eph"}
        Checkpointer.delete(folder / "step4")


def test_changed_intervals_on_resume_delete_no_permanent_checkpoint(
    checkpointer: Checkpointer, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpts"
    run(
        checkpointer,
        folder,
        CheckpointPolicy(save_interval=10, ephemeral_save_interval=5),
        range(0, 27),
    )
    assert kinds(folder) == {0: "perm", 10: "perm", 20: "perm", 25: "eph"}
    # By step arithmetic of the new intervals, 10 and 20 look ephemeral (multiples of 5, not
    # of 7): only their metadata saves them.
    policy = CheckpointPolicy(save_interval=7, ephemeral_save_interval=5)
    run(checkpointer, folder, policy, range(26, 37))
    assert kinds(folder) == {0: "perm", 10: "perm", 20: "perm", 28: "perm", 35: "perm"}


def test_max_checkpoints_across_two_runs(checkpointer: Checkpointer, tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    policy = CheckpointPolicy(save_interval=5, fixed_steps=(7,), max_checkpoints=2)
    run(checkpointer, folder, policy, range(0, 21))
    assert kinds(folder) == {0: "perm", 7: "perm", 15: "perm", 20: "perm"}
    # A second process counts the first one's permanent checkpoints too.
    run(checkpointer, folder, policy, range(21, 31))
    assert kinds(folder) == {0: "perm", 7: "perm", 25: "perm", 30: "perm"}


def test_a_failed_async_save_keeps_the_previous_checkpoints(
    checkpointer: Checkpointer, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpts"
    policy = CheckpointPolicy(save_interval=10, ephemeral_save_interval=5, max_checkpoints=1)
    module = make_module(steps=1)
    driver = CheckpointManager(checkpointer, policy, folder)
    for step in (0, 10, 15):
        driver.maybe_save(step, module, {"step": step})
    checkpointer.wait()
    # Another writer commits step 20 behind the driver's back (two jobs sharing a folder):
    # the driver's async save of step 20 then fails in the background.
    other = CheckpointerConfig(work_dir=tmp_path / "other").build()
    other.save(folder / "step20", make_module(seed=9, steps=0), {"writer": "other"})
    other.close()
    driver.maybe_save(20, module, {"step": 20})
    with pytest.raises(CheckpointError, match=r"step 20 .*already a committed.*are kept"):
        driver.maybe_save(25, module, {"step": 25})
    driver.finish()  # the failure was raised once; the deletions before it succeeded
    assert kinds(folder) == {0: "perm", 10: "perm", 15: "eph", 20: "perm"}
    state = checkpointer.load(folder / "step15", make_module(seed=3, steps=0))
    assert state == {"step": 15}


# DCP's own writer threads re-raise the OS error after reporting it; pytest notes that.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_write_error_in_the_background_surfaces_at_finish(
    checkpointer: Checkpointer, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpts"
    policy = CheckpointPolicy(save_interval=10, ephemeral_save_interval=5)
    small = make_module(steps=1, width=8)
    driver = CheckpointManager(checkpointer, policy, folder)
    driver.maybe_save(5, small, {"step": 5})
    checkpointer.wait()
    # The kernel refuses files over 64 KiB (EFBIG): the next, larger save cannot be written.
    big = make_module(steps=1, width=256)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, old_limit[1]))
    try:
        driver.maybe_save(10, big, {"step": 10})
        with pytest.raises(CheckpointError, match=r"permanent checkpoint of step 10 .*are kept"):
            driver.finish()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert kinds(folder) == {5: "eph"}
    assert not (folder / "step10").exists()


def test_deletion_runs_off_the_training_thread_after_the_replacement_commits(
    checkpointer: Checkpointer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ckpts"
    policy = CheckpointPolicy(save_interval=6, ephemeral_save_interval=2, max_checkpoints=1)
    with caplog.at_level(logging.INFO, logger="trainckpt"):
        run(checkpointer, folder, policy, range(1, 19))
    events = [r for r in caplog.records if "checkpoint event" in r.getMessage()]
    committed: set[int] = set()
    deletes = 0
    for rec in events:
        msg = rec.getMessage()
        step = int(msg.split("'")[1].rsplit("step", 1)[1])
        if "committed" in msg:
            assert "MB/s" in msg
            committed.add(step)
        elif "delete" in msg:
            deletes += 1
            assert rec.threadName.startswith("trainckpt-retention")
            assert any(c > step for c in committed), f"step{step} deleted before a newer commit"
    assert deletes == 8  # ephemeral 2, 4, 8, 10, 14, 16 and permanent 6, 12
    assert kinds(folder) == {18: "perm"}


def test_all_non_permanent_also_clears_leftovers_of_interrupted_saves(
    checkpointer: Checkpointer, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpts"
    for name in ("step3-tmp", "step4", "step40-tmp"):  # crash debris; 40 is newer than all
        (folder / name / "train").mkdir(parents=True)
        (folder / name / "train" / "rank0.pt").write_bytes(b"partial")
    (folder / "notes").mkdir()
    run(checkpointer, folder, CheckpointPolicy(save_interval=5), range(5, 11))
    assert sorted(p.name for p in folder.iterdir()) == [
        "notes",
        "step10",
        "step3-tmp",
        "step4",
        "step40-tmp",
        "step5",
    ]
    run(
        checkpointer,
        folder,
        CheckpointPolicy(save_interval=5, remove="all_non_permanent"),
        range(11, 16),
    )
    assert sorted(p.name for p in folder.iterdir()) == [
        "notes",
        "step10",
        "step15",
        "step40-tmp",
        "step5",
    ]


def test_unreadable_commit_record_is_kept(checkpointer: Checkpointer, tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    run(checkpointer, folder, CheckpointPolicy(ephemeral_save_interval=2), range(1, 3))
    (folder / "step2" / ".metadata.json").write_text("{not json")
    run(checkpointer, folder, CheckpointPolicy(ephemeral_save_interval=2), range(3, 7))
    assert (folder / "step2").is_dir()
    assert sorted(p.name for p in folder.iterdir()) == ["step2", "step6"]


def test_resume_skips_saved_steps_and_explicit_save_waits_for_the_async_one(
    checkpointer: Checkpointer, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpts"
    policy = CheckpointPolicy(save_interval=4, ephemeral_save_interval=2, ephemeral_cooldown=2)
    run(checkpointer, folder, policy, range(0, 5))
    before = (folder / "step4" / ".metadata.json").stat().st_mtime_ns
    module = make_module(steps=1)
    driver = CheckpointManager(checkpointer, policy, folder)
    assert driver.maybe_save(4, module, {"step": 4}) == str(folder / "step4")  # resumed: kept
    assert (folder / "step4" / ".metadata.json").stat().st_mtime_ns == before
    assert driver.maybe_save(5, module, {}) is None
    path = driver.maybe_save(6, module, {"step": 6})  # 2 steps after step 4: cooldown allows
    assert driver.save(6, module, {"step": 6}) == path  # waits for it, saves nothing new
    assert Checkpointer.read_metadata(path).ephemeral
    driver.save(7, module, {"step": 7}, ephemeral=True)  # e.g. on SIGTERM
    driver.finish()
    assert kinds(folder) == {0: "perm", 4: "perm", 7: "eph"}


def _two_rank_run(rank: int, world: int, folder: str) -> dict:
    from support.models import make_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainckpt import CheckpointerConfig, CheckpointManager, CheckpointPolicy, ModelAndOptim

    ckpt = CheckpointerConfig(work_dir=f"{folder}/../work{rank}", fs_timeout=30).build()
    base = make_module(seed=1, steps=0)
    module = ModelAndOptim(DDP(base.model), base.optim)
    policy = CheckpointPolicy(save_interval=4, ephemeral_save_interval=2, max_checkpoints=1)
    driver = CheckpointManager(ckpt, policy, folder)
    paths = [driver.maybe_save(step, module, {"rank": rank, "step": step}) for step in range(0, 11)]
    driver.finish()
    ckpt.close()
    return {"paths": paths}


@pytest.mark.slow
def test_two_ranks_decide_alike_and_rank0_deletes(tmp_path: Path) -> None:
    folder = tmp_path / "ckpts"
    results = run_ranks(_two_rank_run, 2, str(folder))
    assert results[0]["paths"] == results[1]["paths"]
    assert kinds(folder) == {0: "perm", 8: "perm", 10: "eph"}
    assert sorted(p.name for p in (folder / "step10" / "train").iterdir()) == [
        "rank0.pt",
        "rank1.pt",
    ]


def test_old_name_checkpointing_is_the_manager() -> None:
    import trainckpt

    assert trainckpt.Checkpointing is CheckpointManager
    assert "Checkpointing" in trainckpt.__all__ and "CheckpointManager" in trainckpt.__all__
