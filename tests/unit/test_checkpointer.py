"""Checkpointer on a local folder, what the contract (`contract/test_checkpointer_contract.py`,
run on every back end) leaves out: `-tmp` leftovers, async buffers and failures, load options,
bare DCP folders, trainer-state checks, `write_file`, `delete`, file:// URLs."""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointNotFoundError,
    InvalidTrainStateError,
    StorageError,
)


def test_latest_checkpoint_none_names_the_folder(tmp_path):
    (tmp_path / "step5-tmp").mkdir()
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Checkpointer.latest_checkpoint(tmp_path)
    assert not Checkpointer.contains_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        list(Checkpointer.find_checkpoints(tmp_path / "missing"))


def test_crash_leftovers_are_not_checkpoints_and_do_not_block(ckpt, tmp_path):
    stale_tmp = tmp_path / "step5-tmp"
    (stale_tmp / "model_and_optim").mkdir(parents=True)
    (stale_tmp / "model_and_optim" / "__0_0.distcp").write_bytes(b"half")
    torn = tmp_path / "step5"
    (torn / "train").mkdir(parents=True)
    (torn / "train" / "rank0.pt").write_bytes(b"torn")
    assert list(Checkpointer.find_checkpoints(tmp_path)) == []
    assert not Checkpointer.dir_is_checkpoint(torn)

    module = make_module()
    ckpt.save(torn, module, {"step": 5})
    assert not stale_tmp.exists()
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path)] == [5]
    dst = fresh_module()
    ckpt.load(torn, dst)
    assert_same_state(module, dst)


def test_async_save_not_visible_before_commit_and_reuses_buffers(ckpt, tmp_path):
    module = make_module()
    fut = ckpt.save_async(tmp_path / "step1", module, {"step": 1})
    # Whatever the background thread is doing, a finder reports only committed checkpoints.
    found = list(Checkpointer.find_checkpoints(tmp_path))
    assert found in ([], [(1, str(tmp_path / "step1"))])
    if found:
        assert fut.done() or (tmp_path / "step1" / ".metadata.json").exists()
    fut.result()
    staged_bytes = ckpt._stager.nbytes
    ckpt.save_async(tmp_path / "step2", module, {"step": 2}).result()
    assert ckpt._stager.nbytes == staged_bytes > 0


def _failed_async_save(ckpt: Checkpointer, tmp_path: Path) -> Future[str]:
    """An async save that fails in the background: its folder's parent is a file."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    future = ckpt.save_async(blocker / "step1", make_module(), {"step": 1})
    error = future.exception()
    assert type(error) is StorageError and "is a file, not a folder" in str(error), error
    return future


@pytest.mark.parametrize("next_call", ["save", "save_async", "load", "close"])
def test_an_async_error_nobody_read_is_raised_once_by_the_next_call(
    tmp_path: Path, next_call: str
) -> None:
    """The future's error, not read from it, is raised by the next call as it is (the
    documented `StorageError`, not a plain `CheckpointError` around it), and by no later call."""
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    good = ckpt.save(tmp_path / "step1", make_module(), {"step": 1})
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    future = ckpt.save_async(blocker / "step2", make_module(), {"step": 2})
    calls = {
        "save": lambda: ckpt.save(tmp_path / "step3", make_module(), {"step": 3}),
        "save_async": lambda: ckpt.save_async(tmp_path / "step3", make_module(), {"step": 3}),
        "load": lambda: ckpt.load(good, fresh_module()),
        "close": ckpt.close,
    }
    with pytest.raises(StorageError, match="is a file, not a folder") as raised:
        calls[next_call]()
    assert type(raised.value) is StorageError
    assert any(str(blocker / "step2") in note for note in raised.value.__notes__)
    if next_call != "close":
        assert ckpt.load(good, fresh_module()) == {"step": 1}  # raised once
        ckpt.save(tmp_path / "step4", make_module(), {"step": 4})
    ckpt.close()
    assert type(future.exception()) is StorageError  # the future still holds its outcome


def test_an_async_error_read_from_the_future_is_not_raised_again(tmp_path: Path) -> None:
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    good = ckpt.save(tmp_path / "step1", make_module(), {"step": 1})
    future = _failed_async_save(ckpt, tmp_path)
    with pytest.raises(StorageError):
        future.result()
    assert ckpt.load(good, fresh_module()) == {"step": 1}  # not the stale error
    _failed_async_save(ckpt, tmp_path)  # only looked at with exception(): not raised yet
    with pytest.raises(StorageError):
        ckpt.wait()
    assert ckpt.wait() is None  # raised once
    ckpt.save(tmp_path / "step2", make_module(), {"step": 2})
    ckpt.close()


def test_load_options(ckpt, tmp_path):
    src = make_module(seed=1)
    path = ckpt.save(tmp_path / "step1", src, {"step": 1})
    dst = make_module(seed=2)
    optim_before = {k: v.clone() for k, v in dst.optim.state_dict()["state"][0].items()}
    assert ckpt.load(path, dst, load_trainer_state=False, load_optim_state=False) is None
    assert_same_state(src, dst, optim=False)
    for k, v in dst.optim.state_dict()["state"][0].items():
        assert torch.equal(v, optim_before[k])


def test_bare_dcp_folder_loads_model_weights(ckpt, tmp_path):
    src = make_module(seed=3)
    dcp.save({"model": src.model.state_dict()}, checkpoint_id=str(tmp_path / "weights"))
    assert Checkpointer.dir_is_checkpoint(tmp_path / "weights")
    dst = fresh_module()
    assert ckpt.load(tmp_path / "weights", dst) is None
    assert_same_state(src, dst, optim=False)
    with pytest.raises(CheckpointNotFoundError):
        ckpt.load(tmp_path / "weights", dst, load_trainer_state=True)


def test_trainer_state_with_objects_is_refused_at_save(ckpt, tmp_path):
    class Opaque:
        pass

    with pytest.raises(InvalidTrainStateError, match="plain types"):
        ckpt.save(tmp_path / "step1", make_module(), {"loader": Opaque()})
    assert not (tmp_path / "step1").exists() and not (tmp_path / "step1-tmp").exists()


def test_write_file_is_atomic_and_refuses_overwrite(ckpt, tmp_path):
    target = ckpt.write_file(tmp_path / "notes", "config.json", '{"a": 1}')
    assert Path(target).read_text() == '{"a": 1}'
    with pytest.raises(FileExistsError):
        ckpt.write_file(tmp_path / "notes", "config.json", b"other")
    assert Path(target).read_text() == '{"a": 1}'
    assert [p.name for p in (tmp_path / "notes").iterdir()] == ["config.json"]


def test_delete_removes_commit_record_first(ckpt, tmp_path):
    path = ckpt.save(tmp_path / "step1", make_module(), {"step": 1})
    Checkpointer.delete(path)
    assert not Path(path).exists()
    Checkpointer.delete(path)  # missing: ignored


def test_file_url_is_a_local_path(ckpt, tmp_path):
    src = make_module()
    ckpt.save(f"file://{tmp_path}/step1", src, {"step": 1})
    assert Checkpointer.latest_checkpoint(f"file://{tmp_path}") == str(tmp_path / "step1")
    dst = fresh_module()
    ckpt.load(f"file://{tmp_path}/step1", dst)
    assert_same_state(src, dst)
