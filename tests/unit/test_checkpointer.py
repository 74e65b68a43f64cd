"""Checkpointer on a local folder: round trips, commit records, finders, overwrite, leftovers."""

from __future__ import annotations

import json
from pathlib import Path

import google_crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointError,
    CheckpointExistsError,
    CheckpointManifest,
    CheckpointNotFoundError,
    InvalidTrainStateError,
)


def _tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_round_trip_restores_every_tensor_and_trainer_state(ckpt, tmp_path):
    src = make_module(steps=3)
    state = {"step": 3, "rng": torch.get_rng_state(), "data": {"epoch": 1, "offset": [4, 5]}}
    path = ckpt.save(tmp_path / "run" / "step3", src, state)
    assert path == str(tmp_path / "run" / "step3")

    dst = fresh_module()
    loaded = ckpt.load(path, dst)
    assert_same_state(src, dst)
    assert loaded is not None and loaded["step"] == 3 and loaded["data"] == state["data"]
    assert torch.equal(loaded["rng"], state["rng"])


def test_commit_record_holds_exactly_olmo_fields(ckpt, tmp_path):
    path = Path(ckpt.save(tmp_path / "step1", make_module(), {"step": 1}, ephemeral=True))
    record = json.loads((path / ".metadata.json").read_text())
    assert set(record) == {"ephemeral", "version"} and record["ephemeral"] is True
    assert Checkpointer.read_metadata(path).ephemeral is True
    assert not (tmp_path / "step1-tmp").exists()


def test_manifest_matches_real_sizes_and_crc32c(ckpt, tmp_path):
    path = Path(ckpt.save(tmp_path / "step7", make_module(), {"step": 7}))
    manifest = CheckpointManifest.from_json((path / ".manifest.json").read_bytes(), "m")
    on_disk = {
        k: v for k, v in _tree(path).items() if k not in (".metadata.json", ".manifest.json")
    }
    assert set(manifest.files) == set(on_disk)
    assert {"train/rank0.pt", "model_and_optim/.metadata"} <= set(on_disk)
    for rel, data in on_disk.items():
        entry = manifest.files[rel]
        assert entry.size == len(data) and len(data) > 0
        assert entry.crc32c == f"{google_crc32c.value(data):08x}"
    assert manifest.step == 7 and manifest.world_size == 1 and manifest.format == 1


def test_finders_ascending_with_ephemeral_filter(ckpt, tmp_path):
    module = make_module()
    for step, eph in [(100, False), (2, True), (10, False), (20, True)]:
        ckpt.save(tmp_path / f"step{step}", module, {"step": step}, ephemeral=eph)
    run = str(tmp_path)
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [2, 10, 20, 100]
    assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=True)] == [2, 20]
    assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=False)] == [10, 100]
    assert Checkpointer.latest_checkpoint(run) == str(tmp_path / "step100")
    assert Checkpointer.contains_checkpoint(run) and Checkpointer.dir_is_checkpoint(
        tmp_path / "step2"
    )
    assert Checkpointer.checkpoint_dirname(42) == "step42"


def test_latest_checkpoint_none_names_the_folder(tmp_path):
    (tmp_path / "step5-tmp").mkdir()
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        Checkpointer.latest_checkpoint(tmp_path)
    assert not Checkpointer.contains_checkpoint(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        list(Checkpointer.find_checkpoints(tmp_path / "missing"))


def test_committed_target_refused_and_left_intact(ckpt, tmp_path):
    first = make_module(seed=1)
    path = Path(ckpt.save(tmp_path / "step1", first, {"step": 1}))
    before = _tree(path)
    with pytest.raises(CheckpointExistsError, match="save_overwrite"):
        ckpt.save(path, make_module(seed=2), {"step": 1})
    assert _tree(path) == before
    assert not (tmp_path / "step1-tmp").exists()


def test_save_overwrite_replaces_committed_checkpoint(tmp_path):
    c = CheckpointerConfig(work_dir=tmp_path / "w").build(save_overwrite=True)
    c.save(tmp_path / "step1", make_module(seed=1), {"step": 1})
    second = make_module(seed=2)
    c.save(tmp_path / "step1", second, {"step": 1})
    dst = fresh_module()
    c.load(tmp_path / "step1", dst)
    assert_same_state(second, dst)
    c.close()


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


def test_save_async_holds_values_from_the_call(ckpt, tmp_path):
    module = make_module()
    expected = {k: v.clone() for k, v in module.model.state_dict().items()}
    state = {"step": 1, "tokens": torch.arange(4)}
    fut = ckpt.save_async(tmp_path / "step1", module, state)
    with torch.no_grad():  # the trainer steps right away
        for p in module.model.parameters():
            p.add_(1.0)
    state["step"] = 999
    state["tokens"].add_(100)
    assert fut.result() == str(tmp_path / "step1")

    dst = fresh_module()
    loaded = ckpt.load(tmp_path / "step1", dst, load_optim_state=False)
    for k, v in dst.model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    assert loaded is not None and loaded["step"] == 1
    assert torch.equal(loaded["tokens"], torch.arange(4))


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


def test_async_failure_travels_on_future_and_next_call(ckpt, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    fut = ckpt.save_async(blocker / "step1", make_module(), {"step": 1})
    with pytest.raises((OSError, CheckpointError)):
        fut.result()
    with pytest.raises(CheckpointError, match="previous async save failed"):
        ckpt.save(tmp_path / "step2", make_module(), {"step": 2})
    ckpt.save(tmp_path / "step2", make_module(), {"step": 2})  # raised once, then clear


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
