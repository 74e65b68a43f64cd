"""The node-local tier in one process (no process group): settings, the round trip, retention,
leftovers, and hostile parts. The multi-node behaviour is `test_local_tier.py`."""

from __future__ import annotations

import io
import json
import logging
import os
import threading
from pathlib import Path

import pytest
import torch
from support.hostile import Calls, shell, torch_save_bytes
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import Checkpointer, CheckpointerConfig, CheckpointManager, CheckpointPolicy
from trainckpt.errors import ConfigurationError, CorruptCheckpointError
from trainckpt.local.layout import scan
from trainckpt.storage.checksums import crc32c_bytes, crc32c_file
from trainckpt.testing.faults import on_fault_point


def _ckpt(tmp_path: Path, **kw: object) -> Checkpointer:
    return CheckpointerConfig(local_dir=tmp_path / "local", work_dir=tmp_path / "w", **kw).build()


def test_settings_are_validated_and_a_missing_local_dir_is_named(tmp_path: Path):
    with pytest.raises(ConfigurationError, match="replication_factor"):
        CheckpointerConfig.validated({"replication_factor": 0})
    with pytest.raises(ConfigurationError, match="local_keep"):
        CheckpointerConfig.validated({"local_keep": 0})
    plain = CheckpointerConfig(work_dir=tmp_path / "w").build()
    with pytest.raises(ConfigurationError, match="set local_dir"):
        plain.save_local(1, make_module(), {"step": 1})
    with pytest.raises(ConfigurationError, match="set local_dir"):
        plain.latest_local()


def test_round_trip_is_exact_and_keeps_local_keep_steps(tmp_path: Path):
    ckpt = _ckpt(tmp_path, local_keep=2)
    assert ckpt.latest_local() is None
    modules = {}
    for step in (1, 2, 3):
        modules[step] = make_module(seed=step)
        future = ckpt.save_local(step, modules[step], {"step": step})
        assert future.result() == str(tmp_path / "local" / f"step{step}")
    assert ckpt.latest_local() == 3
    assert sorted(p.name for p in (tmp_path / "local").glob("step*")) == ["step2", "step3"]
    for step in (2, 3):
        into = fresh_module()
        assert ckpt.load_local(step, into) == {"step": step}
        assert_same_state(into, modules[step])
    ckpt.close()


def test_ckpt_local_is_the_tier_and_the_old_names_are_its_aliases(tmp_path: Path):
    ckpt = _ckpt(tmp_path)
    first = make_module(seed=1)
    assert ckpt.local.save(1, first, {"step": 1}).result() == str(tmp_path / "local" / "step1")
    ckpt.save_local(2, make_module(seed=2), {"step": 2}).result()  # the alias, same tier
    assert ckpt.local.latest() == ckpt.latest_local() == 2
    into = fresh_module()
    assert ckpt.local.load(1, into) == {"step": 1}
    assert_same_state(into, first)
    assert ckpt.local.load_latest(fresh_module()) == (2, {"step": 2})
    assert ckpt.load_latest_local(fresh_module()) == (2, {"step": 2})
    ckpt.close()
    plain = CheckpointerConfig(work_dir=tmp_path / "w").build()
    with pytest.raises(ConfigurationError, match=r"local\.load_latest: .* set local_dir"):
        plain.local.load_latest(fresh_module())


def test_crashed_leftovers_are_deleted_at_start_and_count_for_nothing(tmp_path: Path):
    ckpt = _ckpt(tmp_path)
    ckpt.save_local(1, make_module(), {"step": 1}).result()
    ckpt.close()
    (commit,) = (tmp_path / "local").glob("step1/*/commit.rank0.json")
    attempt = commit.parent
    stray = attempt.parent.parent / "step2" / attempt.name / "rank0"  # a part never committed
    stray.mkdir(parents=True)
    (stray / "module.pt").write_bytes(b"torn")
    (attempt / ".dirty.tmp").write_bytes(b"")  # a temp file of a crashed write
    assert len(scan(tmp_path / "local")[1]) == 2
    again = _ckpt(tmp_path)
    assert again.latest_local() == 1  # a leftover never makes a restart fail
    assert scan(tmp_path / "local")[1] == []
    assert not (tmp_path / "local" / "step2").exists()


def test_a_damaged_part_record_is_refused_and_logged(tmp_path: Path, caplog):
    ckpt = _ckpt(tmp_path)
    ckpt.save_local(1, make_module(), {"step": 1}).result()
    (record,) = (tmp_path / "local").glob("step1/*/rank0/part.json")
    record.write_text("[" * 100_000)  # larger than a part record ever is
    with caplog.at_level(logging.WARNING):
        assert ckpt.latest_local() is None
    assert "larger than" in caplog.text and str(record) in caplog.text


def test_a_hostile_part_with_matching_checksums_is_never_run(tmp_path: Path):
    marker = tmp_path / "ran"
    payload = torch_save_bytes({"model": Calls(os.system, shell(marker))})
    torch.load(io.BytesIO(payload), weights_only=False)  # proof: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    ckpt = _ckpt(tmp_path)
    ckpt.save_local(1, make_module(), {"step": 1}).result()
    (part,) = (tmp_path / "local").glob("step1/*/rank0")
    (part / "module.pt").write_bytes(payload)
    record = json.loads((part / "part.json").read_text())
    record["files"]["module.pt"] = {"size": len(payload), "crc32c": crc32c_bytes(payload)}
    (part / "part.json").write_text(json.dumps(record))
    assert ckpt.latest_local() == 1
    with pytest.raises(CorruptCheckpointError, match="UnsafeCheckpointError"):
        ckpt.load_local(1, fresh_module())
    assert not marker.exists()


def test_policy_saves_locally_between_save_folder_steps_and_resume_takes_the_newest(
    tmp_path: Path,
):
    policy = CheckpointPolicy(save_interval=4, local_save_interval=1, pre_train_checkpoint=False)
    ckpt = _ckpt(tmp_path)
    driver = CheckpointManager(ckpt, policy, tmp_path / "save")
    modules = {}
    for step in range(1, 7):
        modules[step] = make_module(seed=step)
        driver.maybe_save(step, modules[step], {"step": step})
    driver.finish()
    ckpt.close()
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path / "save")] == [4]
    assert ckpt.latest_local() == 6  # steps 5 and 6 (local_keep=2) went to the local tier

    fresh = fresh_module()
    resumed = CheckpointManager(_ckpt(tmp_path), policy, tmp_path / "save").resume(fresh)
    assert resumed == (6, {"step": 6})
    assert_same_state(fresh, modules[6])

    for part in (tmp_path / "local").glob("step6/*/rank0"):
        (part / "train.pt").write_bytes(b"")  # the only copy of step 6 is lost
    fresh = fresh_module()
    assert CheckpointManager(_ckpt(tmp_path), policy, tmp_path / "save").resume(fresh) == (
        5,
        {"step": 5},
    )

    (module_file,) = (tmp_path / "local").glob("step5/*/rank0/module.pt")
    _flip_byte(module_file)  # same size: step 5 still counts, and fails its check when read
    fresh = fresh_module()
    driver = CheckpointManager(_ckpt(tmp_path), policy, tmp_path / "save")
    assert driver.resume(fresh) == (4, {"step": 4})  # the save folder, not the local tier
    assert_same_state(fresh, modules[4])
    assert driver.resumed_from == str(tmp_path / "save" / "step4")


def _flip_byte(path: Path) -> None:
    """Flip one byte in the middle of `path` (inside the tensor data of a module file)."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def test_a_part_changed_on_disk_during_a_restore_loads_what_was_checked(tmp_path: Path):
    """A byte of the part's module file flips after the restore checked the part and before
    it is loaded (the fault point between the two): what goes into the module is exactly
    what was checked, the saved state (the restore loads its checked private copy)."""
    ckpt = _ckpt(tmp_path)
    saved = make_module(seed=1)
    ckpt.save_local(1, saved, {"step": 1}).result()
    (module_file,) = (tmp_path / "local").glob("step1/*/rank0/module.pt")
    before = crc32c_file(module_file)
    into = fresh_module()
    with on_fault_point("local-restore-checked", lambda: _flip_byte(module_file)):
        assert ckpt.load_local(1, into) == {"step": 1}
    assert crc32c_file(module_file) != before  # the flip happened, during that load
    assert_same_state(into, saved)
    with pytest.raises(CorruptCheckpointError, match="no intact copy"):  # the next read sees it
        ckpt.load_local(1, fresh_module())
    assert list((tmp_path / "local").glob("**/*.tmp")) == []  # the private copy left nothing


def test_retention_keeps_restorable_steps_not_one_that_lost_a_part(tmp_path: Path):
    """With local_keep=2, step 2 loses a part and step 3 is saved: step 2 cannot be restored,
    so it is deleted and step 1 kept; when step 3 is lost too, step 1 restores."""
    ckpt = _ckpt(tmp_path, local_keep=2)
    modules = {step: make_module(seed=step) for step in (1, 2, 3)}
    for step in (1, 2):
        ckpt.save_local(step, modules[step], {"step": step}).result()
    for f in (tmp_path / "local").glob("step2/*/rank0/module.pt"):
        f.unlink()
    ckpt.save_local(3, modules[3], {"step": 3}).result()
    assert ckpt.latest_local() == 3
    assert sorted(p.name for p in (tmp_path / "local").glob("step*")) == ["step1", "step3"]
    for f in (tmp_path / "local").glob("step3/*/rank0/train.pt"):
        f.unlink()
    assert ckpt.latest_local() == 1
    into = fresh_module()
    assert ckpt.load_local(1, into) == {"step": 1}
    assert_same_state(into, modules[1])
    ckpt.close()


def test_a_save_commits_before_retention_deletes_and_close_waits_for_the_deletion(
    tmp_path: Path,
):
    """Deleting the previous step is not part of the commit: the save's future resolves while
    the deletion is held at its fault point; `close()` returns only once it is done (a process
    may exit right after close). The step just committed is never what is deleted."""
    ckpt = _ckpt(tmp_path, local_keep=1)
    ckpt.save_local(1, make_module(seed=1), {"step": 1}).result()
    release, reached, deleted = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:  # after step 1's markers are gone, before its part is
        reached.set()
        release.wait(60)
        deleted.set()

    with on_fault_point("local-cleanup", hold):
        saved = make_module(seed=2)
        future = ckpt.save_local(2, saved, {"step": 2})
        assert future.result(timeout=20) == str(tmp_path / "local" / "step2")
        assert reached.wait(60) and not deleted.is_set()  # committed, deletion still held
        assert (tmp_path / "local" / "step1").exists()
        threading.Timer(0.2, release.set).start()
        ckpt.close()  # waits for the deletion
        assert deleted.is_set()
    assert sorted(p.name for p in (tmp_path / "local").glob("step*")) == ["step2"]
    again = _ckpt(tmp_path, local_keep=1)
    into = fresh_module()
    assert again.load_latest_local(into) == (2, {"step": 2})
    assert_same_state(into, saved)
    again.close()


def test_a_local_interval_without_a_local_dir_is_refused(tmp_path: Path):
    policy = CheckpointPolicy(local_save_interval=10)
    plain = CheckpointerConfig(work_dir=tmp_path / "w").build()
    with pytest.raises(ConfigurationError, match="local_dir"):
        CheckpointManager(plain, policy, tmp_path / "save")
