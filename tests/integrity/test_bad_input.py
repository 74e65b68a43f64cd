"""Bad input gets a clear error naming the path and the fix; hostile files run nothing."""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.damage import RunsCommand, drop_native_metadata, rerecord, shards
from support.models import WithExtra, assert_same_state, fresh_module, make_module
from support.multiproc import run_ranks

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointError,
    CheckpointNotFoundError,
    ConfigurationError,
    CorruptCheckpointError,
    InvalidTrainStateError,
    UnsafeCheckpointError,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def saved(ckpt, tmp_path: Path) -> Path:
    return Path(ckpt.save(tmp_path / "run" / "step2", make_module(), {"step": 2}))


# -- paths ----------------------------------------------------------------------------------------


def test_missing_folder(ckpt, tmp_path):
    missing = tmp_path / "nope" / "step5"
    says = f"'{missing}' does not exist.*latest_checkpoint"
    with pytest.raises(CheckpointNotFoundError, match=says):
        ckpt.load(missing, fresh_module())
    with pytest.raises(CheckpointNotFoundError, match=f"'{missing.parent}' does not exist"):
        list(Checkpointer.find_checkpoints(missing.parent))
    with pytest.raises(CheckpointNotFoundError, match=str(missing.parent)):
        Checkpointer.latest_checkpoint(missing.parent)


def test_file_instead_of_folder(ckpt, tmp_path):
    afile = tmp_path / "weights.pt"
    afile.write_bytes(b"not a folder")
    says = f"'{afile}' is a file, not a checkpoint folder"
    with pytest.raises(CheckpointNotFoundError, match=says):
        ckpt.load(afile, fresh_module())
    with pytest.raises(CheckpointNotFoundError, match=f"'{afile}' is a file, not a folder"):
        list(Checkpointer.find_checkpoints(afile))
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        Checkpointer.verify(afile)


def test_folder_that_is_no_checkpoint(ckpt, tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointNotFoundError, match="is not a checkpoint"):
        ckpt.load(tmp_path / "other", fresh_module())


# -- records --------------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"{not json", b"[1, 2]", b'{"ephemeral": "maybe"}'])
def test_corrupt_or_empty_commit_record(ckpt, saved, content):
    record = saved / ".metadata.json"
    record.write_bytes(content)
    with pytest.raises(CorruptCheckpointError, match=str(record)) as info:
        Checkpointer.read_metadata(saved)
    assert "delete it or restore it from a copy" in str(info.value) or "damaged" in str(info.value)
    if content == b"":
        assert "is empty" in str(info.value)
    with pytest.raises(CorruptCheckpointError, match=str(record)):
        ckpt.load(saved, fresh_module())
    assert not Checkpointer.verify(saved).ok


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"", "is empty"),
        (b'{"format": 1, "files": ', "not JSON"),
        (b'{"format": 3, "files": {}}', "format 3; this trainckpt reads formats 1 and 2: upgrade"),
        (b'{"files": {}}', "format None"),
        (b'{"format": 1, "files": {"a": {"size": -1, "crc32c": "zz"}}}', "not a valid manifest"),
    ],
)
def test_corrupt_empty_or_foreign_manifest(ckpt, saved, content, says):
    manifest = saved / ".manifest.json"
    manifest.write_bytes(content)
    dst, before = fresh_module(), fresh_module()
    with pytest.raises(CorruptCheckpointError, match=str(manifest)) as info:
        ckpt.load(saved, dst)
    assert says in str(info.value)
    assert_same_state(before, dst)
    report = Checkpointer.verify(saved)
    assert not report.ok and says in report.problems[0]


def test_committed_dcp_folder_missing_its_metadata(saved, tmp_path):
    dcp_md = saved / "model_and_optim" / ".metadata"
    dcp_md.unlink()
    for level in ("size", "none"):  # caught by the manifest check, and without it
        c = CheckpointerConfig(work_dir=tmp_path / "work", verify_on_load=level).build()
        with pytest.raises(CorruptCheckpointError, match=str(dcp_md)):
            c.load(saved, fresh_module())


def test_uncommitted_dcp_folder_without_metadata_is_not_a_checkpoint(ckpt, tmp_path):
    bare = tmp_path / "bare"
    dcp.save(make_module().state_dict_to_save(), checkpoint_id=str(bare), no_dist=True)
    (bare / ".metadata").unlink()
    with pytest.raises(CheckpointNotFoundError, match=f"'{bare}' is not a checkpoint"):
        ckpt.load(bare, fresh_module())


# -- trainer state at save time -------------------------------------------------------------------


class Opaque:
    """An arbitrary user object (not a tensor, not a plain type)."""


@pytest.mark.parametrize(
    ("value", "culprit", "hint"),
    [
        (
            np.array([1, None], dtype=object),
            "'extra.data[1]' is a numpy.ndarray of dtype object",
            "object arrays to lists",
        ),
        (Opaque(), "'extra.data[1]' is a test_bad_input.Opaque", "convert other objects first"),
    ],
)
@pytest.mark.parametrize("asynchronous", [False, True])
def test_non_tensor_trainer_state_refused_at_save(
    ckpt, tmp_path, value, culprit, hint, asynchronous
):
    target = tmp_path / "run" / "step1"
    save = ckpt.save_async if asynchronous else ckpt.save
    state = {"step": 1, "extra": {"data": [torch.ones(2), value]}, "rng": torch.get_rng_state()}
    with pytest.raises(InvalidTrainStateError, match=str(target)) as info:
        save(target, make_module(), state)
    assert culprit in str(info.value)
    assert hint in str(info.value)
    assert "plain types" in str(info.value)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


def test_trainer_state_that_is_not_a_dict(ckpt, tmp_path):
    with pytest.raises(InvalidTrainStateError, match="must be a dict, got list"):
        ckpt.save(tmp_path / "step1", make_module(), [1, 2])  # type: ignore[arg-type]


def test_verify_on_load_setting_is_validated(tmp_path):
    with pytest.raises(ConfigurationError, match="verify_on_load"):
        CheckpointerConfig.validated({"verify_on_load": "crc"})


# -- hostile files: nothing from a checkpoint runs ------------------------------------------------


def _evil_torch_save(marker: Path) -> bytes:
    buf = io.BytesIO()
    torch.save({"step": 2, "payload": RunsCommand(marker)}, buf)
    return buf.getvalue()


@pytest.mark.parametrize("level", ["none", "size", "full"])
def test_trainer_state_pickle_that_would_run_a_command(tmp_path, saved, level):
    marker = tmp_path / "pwned"
    rank0 = saved / "train" / "rank0.pt"
    rank0.write_bytes(_evil_torch_save(marker))
    rerecord(saved, "train/rank0.pt")  # the manifest vouches for it: only weights_only stands
    assert Checkpointer.verify(saved, deep=True).ok
    c = CheckpointerConfig(work_dir=tmp_path / "work", verify_on_load=level).build()
    with pytest.raises(UnsafeCheckpointError, match=str(rank0)) as info:
        c.load(saved, fresh_module())
    assert "nothing from it was run" in str(info.value)
    assert not marker.exists()


def test_dcp_metadata_pickle_that_would_run_a_command(ckpt, tmp_path, saved):
    marker = tmp_path / "pwned"
    dcp_md = saved / "model_and_optim" / ".metadata"
    dcp_md.write_bytes(pickle.dumps(RunsCommand(marker)))
    rerecord(saved, "model_and_optim/.metadata")
    drop_native_metadata(saved)
    with pytest.raises(UnsafeCheckpointError, match=str(dcp_md)) as info:
        ckpt.load(saved, fresh_module())
    assert "posix.system" in str(info.value) or "os.system" in str(info.value)
    assert not marker.exists()


def test_dcp_value_pickle_that_would_run_a_command(ckpt, tmp_path):
    marker = tmp_path / "pwned"
    bare = tmp_path / "bare"
    evil = WithExtra(RunsCommand(marker))
    dcp.save(evil.state_dict_to_save(), checkpoint_id=str(bare), no_dist=True)  # runs nothing
    assert not marker.exists()
    target = WithExtra(None)
    with pytest.raises(UnsafeCheckpointError, match="'extra'") as info:
        ckpt.load(bare, target)
    assert isinstance(info.value, Exception)  # not DCP's BaseException: trainers can catch it
    assert target.loaded is None and not marker.exists()


def test_plain_dcp_values_still_load(ckpt, tmp_path):
    bare = tmp_path / "bare"
    state = WithExtra("epoch 3, shard 7").state_dict_to_save()
    dcp.save(state, checkpoint_id=str(bare), no_dist=True)
    target = WithExtra(None)
    ckpt.load(bare, target)
    assert target.loaded is not None and target.loaded["extra"] == "epoch 3, shard 7"


def test_truncated_shard_without_verification_is_still_a_checkpoint_error(tmp_path, saved):
    """With verify_on_load="none" the reader meets the damage itself: DCP's BaseException is
    turned into a CheckpointError (an Exception) naming the folder."""
    shard = shards(saved)[0]
    shard.write_bytes(shard.read_bytes()[:100])
    c = CheckpointerConfig(work_dir=tmp_path / "work", verify_on_load="none").build()
    with pytest.raises(CheckpointError, match=str(saved / "model_and_optim")):
        c.load(saved, fresh_module())


# -- process groups -------------------------------------------------------------------------------


def _groups(rank: int, world: int, folder: str) -> dict:
    import torch.distributed as dist
    from support.models import make_module

    from trainckpt import CheckpointerConfig, ConfigurationError
    from trainckpt.core.dist import check_cpu_group, has_cpu_backend

    gloo = dist.new_group(backend="gloo")
    check_cpu_group(gloo)  # a real gloo group passes
    ckpt = CheckpointerConfig(work_dir=f"{folder}/work{rank}").build(process_group=gloo)
    committed = ckpt.save_async(f"{folder}/step1", make_module(), {"rank": rank}).result()
    ckpt.close()

    # A group whose only backend is for CUDA devices (as an NCCL group is): refused up front.
    cuda_only = dist.new_group(backend="cuda:fake")
    error = ""
    try:
        CheckpointerConfig(work_dir=f"{folder}/work{rank}").build(process_group=cuda_only)
    except ConfigurationError as e:
        error = str(e)
    return {"committed": committed, "gloo": has_cpu_backend(gloo), "error": error}


@pytest.mark.slow
def test_process_group_without_cpu_backend_is_refused(tmp_path):
    results = run_ranks(_groups, 2, str(tmp_path))
    for r in results:
        assert r["committed"] == str(tmp_path / "step1") and r["gloo"]
        assert "cannot run collectives on CPU tensors" in r["error"]
        assert "backend='gloo'" in r["error"]
    assert Checkpointer.verify(tmp_path / "step1", deep=True).ok
