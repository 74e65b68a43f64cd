"""`Checkpointer.verify`, `verify_on_load` and `find_latest_good` on real damaged checkpoints."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.damage import flip_byte, read_manifest, rerecord, shards, truncate, write_manifest
from support.models import assert_same_state, fresh_module, make_module
from support.multiproc import run_ranks

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _build(tmp_path: Path, **kw) -> Checkpointer:
    return CheckpointerConfig(work_dir=tmp_path / "work", **kw).build()


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    """A committed checkpoint of `make_module(steps=3)` with trainer state {"step": 3}."""
    c = _build(tmp_path)
    path = Path(c.save(tmp_path / "run" / "step3", make_module(steps=3), {"step": 3}))
    c.close()
    return path


def _untouched_load_fails(ckpt: Checkpointer, path: Path, match: str) -> None:
    """`load` raises a CorruptCheckpointError matching `match` and leaves the target as it was:
    no wrong tensor reaches the model."""
    dst, before = fresh_module(), fresh_module()
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        ckpt.load(path, dst)
    assert isinstance(info.value, Exception)
    assert_same_state(before, dst)


def test_fresh_checkpoint_verifies_shallow_and_deep(saved):
    manifest = read_manifest(saved)
    total = sum(e["size"] for e in manifest["files"].values())
    seen: list[int] = []
    shallow = Checkpointer.verify(saved)
    deep = Checkpointer.verify(saved, deep=True, progress=seen.append)
    for report in (shallow, deep):
        assert report.ok and report.problems == [] and not report.unverifiable
        assert report.files_checked == len(manifest["files"]) >= 3
        assert report.bytes_checked == total
    assert sum(seen) == total and deep.deep
    assert "ok" in str(deep)


def test_flipped_byte_caught_by_deep_verify_and_full_load(saved, tmp_path):
    shard = shards(saved)[0]
    flip_byte(shard)
    assert Checkpointer.verify(saved).ok  # same size: only the checksum can tell
    report = Checkpointer.verify(saved, deep=True)
    assert not report.ok
    assert len(report.problems) == 1
    assert str(shard) in report.problems[0] and "CRC32C" in report.problems[0]
    ckpt = _build(tmp_path, verify_on_load="full")
    _untouched_load_fails(ckpt, saved, str(shard))


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_truncated_or_missing_shard_fails_verify_and_default_load(saved, tmp_path, damage):
    shard = shards(saved)[0]
    if damage == "truncated":
        truncate(shard)
    else:
        shard.unlink()
    report = Checkpointer.verify(saved)
    assert not report.ok
    assert [p for p in report.problems if str(shard) in p]
    assert ("bytes, the manifest says" if damage == "truncated" else "is missing") in str(report)
    ckpt = _build(tmp_path)  # verify_on_load defaults to "size"
    assert ckpt.verify_on_load == "size"
    _untouched_load_fails(ckpt, saved, str(shard))


def test_truncated_trainer_state_fails_load(saved, tmp_path):
    rank0 = saved / "train" / "rank0.pt"
    truncate(rank0, keep=10)
    ckpt = _build(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=str(rank0)):
        ckpt.load(saved, fresh_module())


def test_unexpected_file_is_reported(saved):
    extra = saved / "model_and_optim" / "__9_0.distcp"
    extra.write_bytes(b"x" * 10)
    report = Checkpointer.verify(saved)
    assert not report.ok and report.problems == [
        f"'{extra}' is not in the manifest (an unexpected file; "
        "remove it if it was added to the checkpoint after the save)"
    ]


@pytest.mark.parametrize("entry", ["../../x", "/etc/hostname", "model_and_optim/../../../x"])
def test_escaping_manifest_entry_is_reported_not_opened(saved, entry):
    outside = saved.parent.parent / "x"
    outside.write_bytes(b"secret")
    manifest = read_manifest(saved)
    manifest["files"][entry] = {"size": 6, "crc32c": "00000000"}
    write_manifest(saved, manifest)
    for deep in (False, True):
        read: list[int] = []
        report = Checkpointer.verify(saved, deep=deep, progress=read.append)
        assert not report.ok
        assert report.problems == [
            f"manifest entry '{entry}' escapes the checkpoint folder; it was not opened "
            "(the manifest is damaged or was tampered with)"
        ]
        # only the real files were counted and read: the escaping entry was never opened
        real = sum(e["size"] for k, e in manifest["files"].items() if k != entry)
        assert report.bytes_checked == real and sum(read) == real


def test_manifest_listing_a_commit_record_is_reported(saved):
    manifest = read_manifest(saved)
    manifest["files"][".metadata.json"] = {"size": 1, "crc32c": "00000000"}
    write_manifest(saved, manifest)
    report = Checkpointer.verify(saved)
    assert any("names a commit record" in p for p in report.problems)


def test_checkpoint_without_manifest_is_valid_but_unverifiable(saved, tmp_path):
    (saved / ".manifest.json").unlink()  # what OLMo-core writes: no manifest
    report = Checkpointer.verify(saved, deep=True)
    assert report.ok and report.unverifiable
    assert "unverifiable" in str(report)
    for level in ("size", "full"):
        dst = fresh_module()
        state = _build(tmp_path, verify_on_load=level).load(saved, dst)
        assert state == {"step": 3}
        assert_same_state(make_module(steps=3), dst)


def test_bare_dcp_folder_is_unverifiable_and_loads(tmp_path):
    src = make_module(steps=2)
    dcp.save(src.state_dict_to_save(), checkpoint_id=str(tmp_path / "bare"), no_dist=True)
    report = Checkpointer.verify(tmp_path / "bare")
    assert report.ok and report.unverifiable
    dst = fresh_module()
    _build(tmp_path, verify_on_load="full").load(tmp_path / "bare", dst)
    assert_same_state(src, dst)


def test_committed_checkpoint_missing_its_dcp_metadata_without_manifest(saved):
    (saved / ".manifest.json").unlink()
    (saved / "model_and_optim" / ".metadata").unlink()
    report = Checkpointer.verify(saved)
    assert not report.ok and "model_and_optim/.metadata' is missing" in report.problems[0]


def test_uncommitted_folder_is_a_problem(saved):
    (saved / ".metadata.json").unlink()
    report = Checkpointer.verify(saved)
    assert not report.ok
    assert "not a committed checkpoint" in report.problems[0]
    assert str(saved / ".metadata.json") in report.problems[0]


def test_verify_of_missing_path_or_file_raises_naming_it(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        Checkpointer.verify(tmp_path / "nope")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="is a file, not a checkpoint folder"):
        Checkpointer.verify(tmp_path / "afile")


def test_verify_on_load_none_skips_the_check(saved, tmp_path):
    extra = saved / "notes.txt"
    extra.write_text("added later")
    with pytest.raises(CorruptCheckpointError, match="notes.txt"):
        _build(tmp_path).load(saved, fresh_module())
    dst = fresh_module()
    assert _build(tmp_path, verify_on_load="none").load(saved, dst) == {"step": 3}
    assert_same_state(make_module(steps=3), dst)


def test_full_load_catches_a_tampered_trainer_state_whose_size_matches(saved, tmp_path):
    rank0 = saved / "train" / "rank0.pt"
    flip_byte(rank0, offset=rank0.stat().st_size - 30)
    with pytest.raises(CorruptCheckpointError, match=str(rank0)):
        _build(tmp_path, verify_on_load="full").load(saved, fresh_module())
    rerecord(saved, "train/rank0.pt")  # an attacker who also fixes the manifest: see test_bad_input
    assert Checkpointer.verify(saved, deep=True).ok


# -- find_latest_good -----------------------------------------------------------------------------


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """A folder with step1..step3, each holding make_module(steps=N)."""
    c = _build(tmp_path)
    for n in (1, 2, 3):
        c.save(tmp_path / "run" / f"step{n}", make_module(steps=n), {"step": n})
    c.close()
    return tmp_path / "run"


def test_find_latest_good_skips_damaged_with_warning(run, tmp_path, caplog):
    ckpt = _build(tmp_path)
    assert ckpt.find_latest_good(run) == str(run / "step3")
    truncate(shards(run / "step3")[0])
    with caplog.at_level(logging.WARNING, logger="trainckpt"):
        good = ckpt.find_latest_good(run)
    assert good == str(run / "step2")
    warning = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warning) == 1
    assert f"skipping checkpoint '{run / 'step3'}'" in warning[0]
    assert "bytes, the manifest says" in warning[0]
    dst = fresh_module()
    assert ckpt.load(good, dst) == {"step": 2}
    assert_same_state(make_module(steps=2), dst)


def test_find_latest_good_full_catches_flipped_byte_and_skips_uncommitted(run, tmp_path):
    flip_byte(shards(run / "step3")[0])
    shutil.copytree(run / "step2", run / "step4")
    (run / "step4" / ".metadata.json").unlink()  # an interrupted save: not a checkpoint
    assert _build(tmp_path).find_latest_good(run) == str(run / "step3")  # sizes only
    assert _build(tmp_path, verify_on_load="full").find_latest_good(run) == str(run / "step2")


def test_find_latest_good_none_when_nothing_good_or_no_folder(run, tmp_path):
    ckpt = _build(tmp_path)
    for n in (1, 2, 3):
        (run / f"step{n}" / "train" / "rank0.pt").unlink()
    assert ckpt.find_latest_good(run) is None
    assert ckpt.find_latest_good(tmp_path / "never-created") is None
    (tmp_path / "afile").write_text("x")
    with pytest.raises(CheckpointNotFoundError, match="is a file"):
        ckpt.find_latest_good(tmp_path / "afile")


# -- two ranks ------------------------------------------------------------------------------------


def _two_rank_integrity(rank: int, world: int, folder: str) -> dict:
    from support.damage import flip_byte, shards, truncate
    from support.models import make_module

    from trainckpt import CheckpointerConfig, CorruptCheckpointError

    ckpt = CheckpointerConfig(work_dir=f"{folder}/work{rank}", verify_on_load="full").build()
    for n in (1, 2, 3):
        ckpt.save(f"{folder}/run/step{n}", make_module(steps=n), {"step": n, "rank": rank})
    if rank == 1:  # one rank damages the files; every rank must reach the same answers
        truncate(shards(Path(folder, "run", "step3"))[0])
        flip_byte(Path(folder, "run", "step2", "train", "rank1.pt"))
    torch.distributed.barrier()  # damage done before anyone looks
    good = ckpt.find_latest_good(f"{folder}/run")
    errors = []
    for n in (2, 3):
        try:
            ckpt.load(f"{folder}/run/step{n}", make_module(steps=0))
        except CorruptCheckpointError as e:
            errors.append(str(e))
    state = ckpt.load(good, make_module(steps=0)) if good else None
    ckpt.close()
    return {"good": good, "errors": errors, "state": state}


@pytest.mark.slow
def test_two_ranks_agree_on_corruption(tmp_path):
    results = run_ranks(_two_rank_integrity, 2, str(tmp_path))
    # step3 is truncated, step2 has a flipped byte (only a CRC32C shows it): step1 on every rank
    assert [r["good"] for r in results] == [str(tmp_path / "run" / "step1")] * 2
    for rank, r in enumerate(results):
        assert r["state"] == {"step": 1, "rank": rank}
        assert len(r["errors"]) == 2
        assert str(tmp_path / "run" / "step2" / "train" / "rank1.pt") in r["errors"][0]
        assert "step3/model_and_optim/__" in r["errors"][1]


# -- a storage that cannot list (HTTP) ------------------------------------------------------------


def test_verify_and_load_over_http_check_each_manifest_file(http_folder, tmp_path):
    root, url = http_folder
    c = _build(tmp_path, verify_on_load="full")
    c.save(root / "step1", make_module(steps=1), {"step": 1})
    report = Checkpointer.verify(f"{url}/step1", deep=True)
    assert report.ok and report.files_checked == len(read_manifest(root / "step1")["files"])
    dst = fresh_module()
    assert c.load(f"{url}/step1", dst) == {"step": 1}
    assert_same_state(make_module(steps=1), dst)

    shard = shards(root / "step1")[0]
    truncate(shard)
    report = Checkpointer.verify(f"{url}/step1")
    assert not report.ok and f"{url}/step1/model_and_optim/{shard.name}" in report.problems[0]
    _untouched_load_fails(c, f"{url}/step1", shard.name)
