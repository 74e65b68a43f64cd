"""torchtitan's folder layout in trainckpt's core, without torchtitan: `step-N` checkpoints with
DCP files at their top, written through the commit protocol, and `step-N` folders torchtitan
wrote (plain DCP, no commit record): found, checked against DCP's own metadata, and never
deleted as leftovers by retention or `prune`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.models import TinyNet

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointError,
    CheckpointManager,
    CheckpointPolicy,
    ModelAndStates,
)
from trainckpt.format.folder_scan import scan_folder
from trainckpt.format.torchtitan_layout import dcp_problems, torchtitan_checkpoints
from trainckpt.retention.prune import plan_prune
from trainckpt.storage import resolve


def _torchtitan_writes(folder: Path, step: int, model: torch.nn.Module) -> Path:
    """What torchtitan's manager writes: plain `dcp.save` of the flat state into `step-N`."""
    path = folder / f"step-{step}"
    dcp.save({**model.state_dict(), "train_state": {"step": step}}, checkpoint_id=str(path))
    return path


def test_torchtitan_naming_through_the_policy_driver(tmp_path):
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    torch.manual_seed(0)
    model = TinyNet()
    driver = CheckpointManager(
        ckpt,
        CheckpointPolicy(save_interval=2, max_checkpoints=1, pre_train_checkpoint=False),
        tmp_path / "run",
        naming="torchtitan",
    )
    for step in range(1, 5):
        driver.maybe_save(step, ModelAndStates(model, {}), {})
    driver.finish()
    ckpt.close()
    path = tmp_path / "run" / "step-4"
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-4"]
    assert (path / ".metadata").exists() and not (path / "model_and_optim").exists()
    assert Checkpointer.verify(path, deep=True).ok
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path / "run")] == [4]
    # torchtitan's own reader: plain DCP into its flat state
    target = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(target, checkpoint_id=str(path))
    assert all(torch.equal(target[k], v) for k, v in model.state_dict().items())


def test_checkpoints_torchtitan_wrote_are_found_checked_and_never_deleted(tmp_path):
    folder = tmp_path / "run"
    model = TinyNet()
    old = _torchtitan_writes(folder, 2, model)
    new = _torchtitan_writes(folder, 4, model)
    storage, path = resolve(str(folder))
    assert torchtitan_checkpoints(storage, path) == [(2, str(old)), (4, str(new))]
    assert dcp_problems(storage, str(new)) == []
    shard = next(new.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:10])
    assert any(
        "DCP's metadata records data up to byte" in p for p in dcp_problems(storage, str(new))
    )
    shard.unlink()
    assert any("is missing" in p for p in dcp_problems(storage, str(new)))

    # a trainckpt checkpoint beside them, then retention that deletes leftovers
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    driver = CheckpointManager(
        ckpt,
        CheckpointPolicy(save_interval=6, remove="all_non_permanent", pre_train_checkpoint=False),
        folder,
        naming="torchtitan",
    )
    driver.maybe_save(6, ModelAndStates(model, {}), {})
    driver.finish()
    ckpt.close()
    assert old.exists() and new.exists()
    entries = scan_folder(*resolve(str(folder)))
    assert [e.name for e in entries] == ["step-6"]
    plan = plan_prune(str(folder), entries, keep_last=1, keep_ephemeral=False)
    assert not plan.to_delete


def test_save_files_commits_arbitrary_files_or_nothing(tmp_path):
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()

    def two_files(folder: Path) -> list[str]:
        (folder / "a.bin").write_bytes(b"a" * 100)
        (folder / "sub").mkdir()
        (folder / "sub" / "b.json").write_text("{}")
        return ["a.bin", "sub/b.json"]

    path = ckpt.save_files(tmp_path / "run" / "step-3", two_files)
    report = Checkpointer.verify(path, deep=True)
    assert report.ok and not report.unverifiable
    assert set(report.manifest.files) >= {"a.bin", "sub/b.json"}

    def escaping(folder: Path) -> list[str]:
        return ["../outside"]

    def failing(folder: Path) -> list[str]:
        (folder / "half").write_bytes(b"x")
        raise OSError("disk full")

    for bad in (escaping, failing):
        with pytest.raises(CheckpointError):
            ckpt.save_files(tmp_path / "run" / "step-4", bad)
    ckpt.close()
    assert [s for s, _ in Checkpointer.find_checkpoints(tmp_path / "run")] == [3]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["step-3"]
