"""Symbolic links in a save folder never lead a save or a deletion outside it (issue 13, item 5).

Each test points links at a folder outside the save folder holding a sentinel file and files
named like a checkpoint's; after saves (with and without `save_overwrite`), `Checkpointer.delete`,
`trainckpt prune` and retention, that folder must be byte for byte what it was. A link in a
step entry loses only the link (`LocalStorage.delete_tree`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.crash_worker import check_checkpoint, reference, trainer_state

from trainckpt import Checkpointer, CheckpointerConfig, CheckpointExistsError, CheckpointPolicy
from trainckpt.cli.main import main as cli_main
from trainckpt.retention.remover import Remover


@pytest.fixture
def overwriting(tmp_path: Path) -> Iterator[Checkpointer]:
    c = CheckpointerConfig(work_dir=tmp_path / "work", save_overwrite=True).build()
    yield c
    c.close()


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder outside the save folder: a sentinel and files named like a checkpoint's."""
    out = tmp_path / "outside"
    for rel, data in {
        "SENTINEL": b"must survive",
        "train/rank0.pt": b"not a checkpoint's",
        "model_and_optim/__0_0.distcp": b"not a checkpoint's either",
        "model_and_optim/.metadata": b"nor this",
    }.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    return out


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file below `folder` (links not followed) with its bytes."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


@pytest.mark.parametrize("entry", ["step5", "step5-tmp"])
def test_save_over_a_symlinked_step_entry_removes_only_the_link(ckpt, tmp_path, outside, entry):
    save = tmp_path / "save"
    save.mkdir()
    (save / entry).symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)
    path = ckpt.save(str(save / "step5"), reference(5), trainer_state(5))
    assert snapshot(outside) == before
    assert not (save / "step5").is_symlink() and not (save / "step5-tmp").exists()
    check_checkpoint(path, 5, tmp_path / "check")


def test_overwrite_of_a_symlinked_committed_checkpoint_keeps_its_target(
    ckpt, overwriting, tmp_path
):
    elsewhere = tmp_path / "elsewhere"
    target = ckpt.save(str(elsewhere / "step5"), reference(3), trainer_state(3))
    (elsewhere / "SENTINEL").write_bytes(b"must survive")
    save = tmp_path / "save"
    save.mkdir()
    (save / "step5").symlink_to(target, target_is_directory=True)
    before = snapshot(elsewhere)

    with pytest.raises(CheckpointExistsError):  # without save_overwrite: refused, untouched
        ckpt.save(str(save / "step5"), reference(5), trainer_state(5))
    assert (save / "step5").is_symlink() and snapshot(elsewhere) == before

    path = overwriting.save(str(save / "step5"), reference(5), trainer_state(5))
    assert not (save / "step5").is_symlink()
    check_checkpoint(path, 5, tmp_path / "check")
    assert snapshot(elsewhere) == before
    check_checkpoint(target, 3, tmp_path / "check")


def test_links_inside_a_leftover_are_removed_as_links(ckpt, tmp_path, outside):
    save = tmp_path / "save"
    (save / "step5" / "train").mkdir(parents=True)
    (save / "step5" / "train" / "rank0.pt").symlink_to(outside / "SENTINEL")
    (save / "step5" / "model_and_optim").symlink_to(outside / "model_and_optim")
    (save / "step5-tmp").mkdir()
    (save / "step5-tmp" / "model_and_optim").symlink_to(outside / "model_and_optim")
    before = snapshot(outside)
    path = ckpt.save(str(save / "step5"), reference(5), trainer_state(5))
    assert snapshot(outside) == before
    check_checkpoint(path, 5, tmp_path / "check")


def test_deletions_never_follow_links(ckpt, tmp_path, outside):
    """`Checkpointer.delete`, `trainckpt prune` and retention, over step entries that are links
    and step folders holding links."""
    save = tmp_path / "save"
    for step in (1, 2, 3):
        ckpt.save(str(save / f"step{step}"), reference(step), trainer_state(step))
    (save / "step1" / "train" / "rank1.pt").symlink_to(outside / "SENTINEL")
    (save / "step0").mkdir()  # an uncommitted leftover holding links
    (save / "step0" / "model_and_optim").symlink_to(outside / "model_and_optim")
    (save / "step0" / ".metadata.json.partial").symlink_to(outside / "SENTINEL")
    (save / "step4-tmp").symlink_to(outside, target_is_directory=True)
    (save / "step7").symlink_to(outside, target_is_directory=True)
    before = snapshot(outside)

    Checkpointer.delete(save / "step7")
    assert not (save / "step7").is_symlink() and snapshot(outside) == before

    policy = CheckpointPolicy(remove="all_non_permanent", max_checkpoints=2)
    deleted = Remover(str(save), policy).run_round()
    assert sorted(Path(p).name for p in deleted) == ["step0", "step1"]
    assert snapshot(outside) == before

    assert cli_main(["prune", str(save), "-k", "1"]) == 0
    assert snapshot(outside) == before
    Checkpointer.delete(save / "step4-tmp")
    assert not (save / "step4-tmp").is_symlink() and snapshot(outside) == before
    assert [s for s, _ in Checkpointer.find_checkpoints(save)] == [3]
