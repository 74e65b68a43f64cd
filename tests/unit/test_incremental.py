"""Incremental saves (docs/incremental.md): files of unchanged items are hard links to the
previous checkpoint's, every checkpoint loads alone (trainckpt, plain DCP, OLMo-core) and
verifies, deleting one never affects another, and the hash (not a hint) decides."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import olmo_core.train.checkpoint as olmo_checkpoint
import pytest
import torch
from support.lora import BASE, BASE_BYTES, copy_of, lora_module, train
from support.models import assert_plain_dcp_reads, assert_same_state
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import WriteItemType

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointManager,
    CheckpointPolicy,
    ModelAndOptim,
)
from trainckpt.cli.main import main
from trainckpt.core import dcp as dcp_module
from trainckpt.core import incremental
from trainckpt.format.shard_checksums import SAVE_ID_PREFIX


def shards(path: str | Path) -> dict[str, os.stat_result]:
    folder = Path(path) / "model_and_optim"
    return {p.name: p.stat() for p in sorted(folder.glob("*.distcp"))}


def linked(a: str | Path, b: str | Path) -> set[str]:
    """Names of the shard files of `b` that are the same file (inode) as one of `a`."""
    inodes = {s.st_ino for s in shards(a).values()}
    return {name for name, s in shards(b).items() if s.st_ino in inodes}


@pytest.fixture
def run(tmp_path: Path) -> tuple[Checkpointer, ModelAndOptim, Path]:
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    yield ckpt, lora_module(), tmp_path / "run"
    ckpt.close()


def test_unchanged_files_are_hard_links_and_each_checkpoint_loads_alone(run, tmp_path):
    ckpt, module, folder = run
    saved = []
    for step in (1, 2, 3):
        train(module, step)
        ckpt.save(folder / f"step{step}", module, {"step": step})
        saved.append(copy_of(module))

    # From the second save on, the frozen base is linked, not written: new bytes are the
    # adapter, its optimizer state and records, far below the base's.
    for prev, new in (("step1", "step2"), ("step2", "step3")):
        reused = linked(folder / prev, folder / new)
        assert reused, f"{new} took no file over from {prev}"
        fresh = sum(s.st_size for n, s in shards(folder / new).items() if n not in reused)
        assert sum(shards(folder / new)[n].st_size for n in reused) >= BASE_BYTES
        assert fresh < BASE_BYTES / 10
    assert linked(folder / "step1", folder / "step3")  # the same file, three names

    # Each checkpoint alone: the others deleted (commit record first, as prune does).
    for keep in (3, 2):
        expected = saved[keep - 1]
        for other in {1, 2, 3} - {keep}:
            shutil.rmtree(folder / f"step{other}", ignore_errors=True)
        path = folder / f"step{keep}"
        assert Checkpointer.verify(path, deep=True).ok
        dst = lora_module(seed=7)
        assert ckpt.load(path, dst) == {"step": keep}
        assert_same_state(expected, dst)
        # plain DCP, reading the same files
        assert_plain_dcp_reads(path, expected)
        # OLMo-core
        dst = lora_module(seed=8)
        olmo = olmo_checkpoint.Checkpointer(work_dir=tmp_path / f"olmo-{keep}")
        assert olmo.load(str(path), dst) == {"step": keep}
        assert_same_state(expected, dst)
        if keep == 3:
            ckpt.save(folder / "step2", module, {"step": 2})  # a new step2 to keep alone next
            saved[1] = copy_of(module)


def test_the_hash_decides_not_the_version_counter(run):
    """A write through `.data` bumps no version counter, and a frozen parameter changes: the
    file holding it is written anew, and the checkpoint holds the new value."""
    ckpt, module, folder = run
    train(module, 1)
    ckpt.save(folder / "step1", module, {"step": 1})
    base = module.model[0].weight
    version = base._version
    base.data[3, 5] += 1.0
    assert base._version == version
    ckpt.save(folder / "step2", module, {"step": 2})
    reused = linked(folder / "step1", folder / "step2")
    dst = lora_module(seed=5)
    ckpt.load(folder / "step2", dst)
    assert torch.equal(dst.model[0].weight, base)
    # the bias did not change: its file (of its own) is linked; the weight's is not
    assert reused and all(shards(folder / "step2")[n].st_size < BASE * BASE * 4 for n in reused), (
        reused
    )


def test_shortcuts_never_link_a_change_made_behind_the_version_counter(run):
    """Once a run is steady (the plan, the changed-items hint, the byte items' hashes and the
    taken-over files' results all kept from save to save), a frozen tensor changed through
    NumPy, through a view of `.data`, or by `set_` onto other bytes (no version counter bump
    on the parameter), and a hyperparameter changed in place, are each written, never
    linked: every checkpoint loads as the state was."""
    ckpt, module, folder = run
    base = module.model[0].weight
    expected = {}

    def save(step: int) -> None:
        ckpt.save(folder / f"step{step}", module, {"step": step})
        expected[step] = copy.deepcopy(module)  # shares no tensor (copy_of shares `step`)

    for step in (1, 2, 3):
        train(module, step)
        save(step)
    assert linked(folder / "step2", folder / "step3")

    version = base._version
    base.detach().numpy()[7, 9] += 1.0  # through NumPy
    assert base._version == version
    train(module, 4)
    save(4)
    assert all(
        shards(folder / "step4")[n].st_size < BASE * BASE * 4
        for n in linked(folder / "step3", folder / "step4")
    )

    view = base.data[2:4]
    view.mul_(2.0)  # through a view of .data
    assert base._version == version
    save(5)  # no training step: only the base changed

    with torch.no_grad():
        base.set_(base.detach().clone().add_(1.0))  # other bytes, same kind
    module.optim.param_groups[0]["lr"] = 0.5  # a byte item, changed in place
    save(6)
    assert all(
        shards(folder / "step6")[n].st_size < BASE * BASE * 4
        for n in linked(folder / "step5", folder / "step6")
    )

    for step, state in expected.items():
        dst = lora_module(seed=5)
        ckpt.load(folder / f"step{step}", dst)
        assert_same_state(state, dst)
    assert expected[6].optim.param_groups[0]["lr"] == 0.5


def test_hyperparameters_are_linked_from_the_second_save_and_a_new_lr_is_written(run):
    """The optimizer's hyperparameters fill files of their own from the first save: the second
    save writes exactly the files the third writes (the adapter's), and takes the rest over.
    A learning rate changed between two saves is written, while the base stays linked, and
    the checkpoint holds the new value."""
    ckpt, module, folder = run
    assert module.optim is not None
    saved = {}
    for step in (1, 2, 3):
        train(module, step)
        ckpt.save(folder / f"step{step}", module, {"step": step})
        saved[step] = copy.deepcopy(module)
    new = {
        s: set(shards(folder / f"step{s}")) - linked(folder / f"step{s - 1}", folder / f"step{s}")
        for s in (2, 3)
    }
    assert new[2] == new[3] and len(new[2]) < len(shards(folder / "step2")) - 2, new
    for group in module.optim.param_groups:
        group["lr"] = 5e-3  # a scheduler's step
    train(module, 4)
    ckpt.save(folder / "step4", module, {"step": 4})
    saved[4] = copy.deepcopy(module)
    reused = linked(folder / "step3", folder / "step4")
    assert sum(shards(folder / "step4")[n].st_size for n in reused) >= BASE_BYTES
    for step, state in saved.items():
        dst = lora_module(seed=5)
        ckpt.load(folder / f"step{step}", dst)
        assert_same_state(state, dst)
        assert_plain_dcp_reads(folder / f"step{step}", state)
    assert dst.optim is not None and dst.optim.param_groups[0]["lr"] == 5e-3


def test_a_new_lr_after_a_full_save_keeps_the_base_linked(run):
    """The previous checkpoint deleted, a save writes every file (hashes known, nothing to
    link): the hyperparameters still go to files apart from the base, so a learning rate
    changed before the next save does not keep the base from being linked."""
    ckpt, module, folder = run
    assert module.optim is not None
    for step in (1, 2):
        train(module, step)
        ckpt.save(folder / f"step{step}", module, {"step": step})
    Checkpointer.delete(str(folder / "step2"))
    train(module, 3)
    ckpt.save(folder / "step3", module, {"step": 3})
    for group in module.optim.param_groups:
        group["lr"] = 5e-3
    train(module, 4)
    ckpt.save(folder / "step4", module, {"step": 4})
    reused = linked(folder / "step3", folder / "step4")
    assert sum(shards(folder / "step4")[n].st_size for n in reused) >= BASE_BYTES
    dst = lora_module(seed=5)
    ckpt.load(folder / "step4", dst)
    assert_same_state(module, dst)


def test_a_steady_save_resolves_no_byte_item_whose_value_is_the_same_object(run, monkeypatch):
    """From the second save on, a byte item whose state value is the very immutable object of
    the last save keeps that save's hash without being resolved (a state of many entries has
    tens of thousands); one whose value was replaced (a new learning rate) is resolved (and its
    file written, which resolves the items it holds), and the checkpoint holds the new value."""
    ckpt, module, folder = run
    assert module.optim is not None
    resolved: list[str] = []
    planner = dcp_module._SavePlanner
    resolve = planner.resolve_item

    def counting(self, item):
        if item.type == WriteItemType.BYTE_IO:
            resolved.append(item.index.fqn)
        return resolve(self, item)

    monkeypatch.setattr(planner, "resolve_item", counting)
    counts = []
    for step in (1, 2, 3):
        train(module, step)
        resolved.clear()
        ckpt.save(folder / f"step{step}", module, {"step": step})
        counts.append(len(resolved))
    assert counts[0] > 0 and counts[1:] == [0, 0], counts
    module.optim.param_groups[0]["lr"] = 5e-3
    train(module, 4)
    resolved.clear()
    ckpt.save(folder / "step4", module, {"step": 4})
    lrs = {fqn for fqn in resolved if fqn.endswith(".lr")}
    assert lrs == {"optim.param_groups.1.weight.lr", "optim.param_groups.1.bias.lr"}, resolved
    dst = lora_module(seed=5)
    ckpt.load(folder / "step4", dst)
    assert_same_state(module, dst)
    assert dst.optim is not None and dst.optim.param_groups[0]["lr"] == 5e-3


def test_without_the_planners_values_every_byte_item_is_hashed_at_every_save(run, monkeypatch):
    """A planner that cannot tell the state values behind byte items (no `values_of`): each
    save resolves and hashes every byte item, and a new learning rate is written."""
    ckpt, module, folder = run
    assert module.optim is not None
    monkeypatch.delattr(dcp_module._SavePlanner, "values_of")
    for step in (1, 2, 3):
        train(module, step)
        ckpt.save(folder / f"step{step}", module, {"step": step})
    module.optim.param_groups[0]["lr"] = 5e-3
    train(module, 4)
    ckpt.save(folder / "step4", module, {"step": 4})
    dst = lora_module(seed=5)
    ckpt.load(folder / "step4", dst)
    assert_same_state(module, dst)
    assert dst.optim is not None and dst.optim.param_groups[0]["lr"] == 5e-3


def test_a_mutable_hyperparameter_changed_in_place_and_a_new_plan_are_written_not_linked(run):
    """A hyperparameter held in a list is changed in place (the same object, other bytes):
    the save writes it anew. Then a new hyperparameter appears (a new plan, whose positions
    differ from the last save's): the files the new plan holds unchanged, the frozen base's
    among them, are still taken over, found by key. Each checkpoint loads as saved."""
    ckpt, module, folder = run
    assert module.optim is not None
    group = module.optim.param_groups[0]
    group["milestones"] = [10, 20]
    saved = {}
    for step in (1, 2, 3, 4, 5):
        if step == 4:
            group["milestones"][1] = 30  # in place
        if step == 5:
            group["warmup"] = 100  # a new entry: a new plan
        train(module, step)
        ckpt.save(folder / f"step{step}", module, {"step": step})
        saved[step] = copy.deepcopy(module)
    reused = linked(folder / "step4", folder / "step5")
    assert sum(shards(folder / "step5")[n].st_size for n in reused) >= BASE_BYTES
    for step, state in saved.items():
        dst = copy.deepcopy(state)  # its plan; values that differ from the checkpoint's
        dst.optim.param_groups[0]["milestones"] = [0, 0]
        if step == 5:
            dst.optim.param_groups[0]["warmup"] = -1
        ckpt.load(folder / f"step{step}", dst)
        assert_same_state(state, dst)
        assert dst.optim.param_groups[0]["milestones"] == [10, 20 if step < 4 else 30]
    assert dst.optim.param_groups[0]["warmup"] == 100


def test_items_that_change_in_turn_are_never_described_by_the_last_saves_places(tmp_path):
    """Two parameter groups whose learning rates change in turn (one per save, to values of
    the same size): the files written at each save have the same names, items count and
    places as at the save before, but hold the other group's values. The results and metadata
    kept from the last save must not describe them: every checkpoint loads as it was."""
    torch.manual_seed(0)
    base = torch.nn.Linear(BASE, BASE)
    base.requires_grad_(False)
    model = torch.nn.Sequential(base, torch.nn.Linear(BASE, 4), torch.nn.Linear(BASE, 4))
    groups = [{"params": list(model[1].parameters())}, {"params": list(model[2].parameters())}]
    module = ModelAndOptim(model, torch.optim.AdamW(groups, lr=0.01))
    assert module.optim is not None
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    folder = tmp_path / "run"
    saved = {}
    try:
        for n in range(1, 6):
            for p in (*model[1].parameters(), *model[2].parameters()):
                p.grad = torch.full_like(p, n / 100)
            module.optim.step()
            module.optim.param_groups[n % 2]["lr"] = 0.01 + n / 1000  # the other group's
            ckpt.save(folder / f"step{n}", module, {"step": n})
            saved[n] = copy.deepcopy(module)
        for n, state in saved.items():
            dst = copy.deepcopy(module)
            for group in dst.optim.param_groups:
                group["lr"] = 1.0
            ckpt.load(folder / f"step{n}", dst)
            assert_same_state(state, dst)
            assert_plain_dcp_reads(folder / f"step{n}", state)
    finally:
        ckpt.close()


def test_items_that_stop_changing_are_linked_again(run):
    """Items a save found changed are written at the next save without waiting for their
    hash (hashed while written): once training stops, that hash lets the save after take
    their file over. No shard of the third save after the last step is new."""
    ckpt, module, folder = run
    for step in (1, 2, 3):
        train(module, step)
        ckpt.save(folder / f"step{step}", module, {"step": step})
    for step in (4, 5, 6):
        ckpt.save(folder / f"step{step}", module, {"step": step})
    assert linked(folder / "step5", folder / "step6") == set(shards(folder / "step6"))
    dst = lora_module(seed=5)
    ckpt.load(folder / "step6", dst)
    assert_same_state(module, dst)


@pytest.mark.parametrize("writer", [None, "thread", "process"], ids=["save", "thread", "process"])
def test_a_state_that_keeps_changing_is_hashed_at_two_saves_in_eight(tmp_path, writer):
    """A tensor written as changed save after save is hashed at the first four saves of its
    streak, then at two saves in a row out of `HASH_PERIOD` (8): a state that trains in full
    pays a quarter of the hashing. Every checkpoint, hashed or not, holds the state as saved.
    What a save hashed is what its record holds a hash for: the large weight (2 MiB, hashed on
    the prehash threads) and the small one (hashed by the writers, from its item bytes), with
    a synchronous save, or an async one with writer threads or a writer process."""

    def trained_in_full(seed: int) -> ModelAndOptim:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(BASE, 512), torch.nn.Linear(512, 4))
        return ModelAndOptim(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    module = trained_in_full(0)
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", async_writer=writer or "thread").build()

    def hashed() -> list[bool]:
        """Whether the last committed save holds a hash of each weight."""
        files = ckpt._history._last.files
        digests = {key[0]: digest for f in files for key, digest in f.pairs}
        return [digests[f"model.{n}.weight"] is not None for n in (0, 1)]

    saved: dict[int, ModelAndOptim] = {}
    seen: list[list[bool]] = []
    try:
        for step in range(1, 21):
            train(module, step)
            if writer is not None:
                ckpt.save_async(tmp_path / f"step{step}", module, {"step": step}).result()
            else:
                ckpt.save(tmp_path / f"step{step}", module, {"step": step})
            seen.append(hashed())
            if step in (5, 7, 20):
                saved[step] = copy.deepcopy(module)
        for step, state in saved.items():
            dst = trained_in_full(5)
            ckpt.load(tmp_path / f"step{step}", dst)
            assert_same_state(state, dst)
    finally:
        ckpt.close()
    want = [1, 2, 3, 4, 5, 9, 10, 17, 18]  # the first save, then streaks 1-4, 8-9, 16-17
    assert [s for s, both in enumerate(seen, 1) if all(both)] == want, seen
    assert [s for s, both in enumerate(seen, 1) if any(both)] == want, seen


def test_items_that_stop_changing_after_a_long_streak_are_linked_within_the_period(run):
    """Trained for 12 saves, then left alone: the adapter is hashed again at the next two
    saves in a row that `hash_due` names, and from then on every file is taken over, no more
    than `HASH_PERIOD` saves after the last step. Each checkpoint loads as saved."""
    ckpt, module, folder = run
    for step in range(1, 13):
        train(module, step)
        ckpt.save(folder / f"step{step}", module, {"step": step})
    trained = copy_of(module)
    whole = None
    for step in range(13, 13 + incremental.HASH_PERIOD + 2):
        ckpt.save(folder / f"step{step}", module, {"step": step})
        if linked(folder / f"step{step - 1}", folder / f"step{step}") == set(
            shards(folder / f"step{step}")
        ):
            whole = step
            break
    assert whole is not None and whole - 12 <= incremental.HASH_PERIOD, whole
    for step in (13, whole):
        dst = lora_module(seed=5)
        ckpt.load(folder / f"step{step}", dst)
        assert_same_state(trained, dst)


def test_a_deleted_previous_checkpoint_means_a_full_save(run):
    ckpt, module, folder = run
    train(module, 1)
    ckpt.save(folder / "step1", module, {"step": 1})
    Checkpointer.delete(str(folder / "step1"))
    ckpt.save(folder / "step2", module, {"step": 2})
    assert Checkpointer.verify(folder / "step2", deep=True).ok
    dst = lora_module(seed=5)
    ckpt.load(folder / "step2", dst)
    assert_same_state(module, dst)


def test_a_previous_file_replaced_meanwhile_is_not_taken_over(run, tmp_path):
    """The previous checkpoint is overwritten (same step, same file names, other values) by
    another checkpointer between two saves: the next save checks the item record of each file
    it links, finds another save's, and writes the file instead."""
    ckpt, module, folder = run
    train(module, 1)
    ckpt.save(folder / "step1", module, {"step": 1})
    other = CheckpointerConfig(work_dir=tmp_path / "w2", save_overwrite=True).build()
    other.save(folder / "step1", lora_module(seed=3), {"step": 1})
    other.close()
    ckpt.save(folder / "step2", module, {"step": 2})
    assert not linked(folder / "step1", folder / "step2")
    dst = lora_module(seed=5)
    ckpt.load(folder / "step2", dst)
    assert_same_state(module, dst)


def test_retention_and_prune_over_linked_checkpoints_leave_the_others_whole(run):
    """Retention (a `CheckpointManager` keeping 2) deletes linked checkpoints while the run
    goes on, then `trainckpt prune --keep-last 1`: what is left verifies and loads."""
    ckpt, module, folder = run
    manager = CheckpointManager(ckpt, CheckpointPolicy(save_interval=1, max_checkpoints=2), folder)
    for step in range(1, 5):
        train(module, step)
        manager.save(step, module, {"step": step})
    manager.finish()
    final = copy_of(module)
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [3, 4]
    assert linked(folder / "step3", folder / "step4")
    assert main(["prune", str(folder), "--keep-last", "1"]) == 0
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [4]
    assert all(s.st_nlink == 1 for s in shards(folder / "step4").values())
    assert Checkpointer.verify(folder / "step4", deep=True).ok
    dst = lora_module(seed=5)
    ckpt.load(folder / "step4", dst)
    assert_same_state(final, dst)


def test_the_metadata_names_the_saves_whose_files_it_took_over(run):
    ckpt, module, folder = run
    ckpt.save(folder / "step1", module, {"step": 1})
    train(module, 1)
    ckpt.save(folder / "step2", module, {"step": 2})
    ids = FileSystemReader(str(folder / "step2/model_and_optim")).read_metadata()
    save_ids = ids.storage_meta.save_id.split(",")
    assert len(save_ids) == 2 and all(i.startswith(SAVE_ID_PREFIX) for i in save_ids)


def test_off_switch_writes_every_file(tmp_path):
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", incremental=False).build()
    module = lora_module()
    ckpt.save(tmp_path / "step1", module, {"step": 1})
    ckpt.save(tmp_path / "step2", module, {"step": 2})
    ckpt.close()
    assert not linked(tmp_path / "step1", tmp_path / "step2")
    assert all(s.st_nlink == 1 for s in shards(tmp_path / "step2").values())


def test_async_saves_hash_the_staged_copy(tmp_path):
    """`save_async` returns once staged; the trainer then changes the base in place: the save
    holds (and its successor links only what matches) the state as staged."""
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    module = lora_module()
    try:
        train(module, 1)
        ckpt.save(tmp_path / "step1", module, {"step": 1})
        staged = copy_of(module)
        future = ckpt.save_async(tmp_path / "step2", module, {"step": 2})
        with torch.no_grad():
            module.model[0].weight.mul_(-1.0)  # while step2 may still be writing
        future.result()
        ckpt.save(tmp_path / "step3", module, {"step": 3})
    finally:
        ckpt.close()
    assert linked(tmp_path / "step1", tmp_path / "step2")
    for step, expected in ((2, staged), (3, module)):
        dst = lora_module(seed=5)
        reader = CheckpointerConfig(work_dir=tmp_path / "work2").build()
        reader.load(tmp_path / f"step{step}", dst)
        reader.close()
        assert_same_state(expected, dst)


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_staging_skips_only_copies_whose_buffer_holds_the_same_bytes(tmp_path, writer):
    """An async save does not copy a large tensor whose staging buffer holds its bytes already
    (the last save hashed the buffer; the source has that hash), and copies every one that
    differs, also when it changed through `.data` (no version counter bump): each checkpoint
    holds the state as it was when `save_async` returned, whatever the trainer did after."""
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", async_writer=writer).build()
    module = lora_module()
    base = module.model[0].weight
    original = base.detach().clone()
    expected = {}
    try:
        train(module, 1)
        ckpt.save_async(tmp_path / "step1", module, {"step": 1}).result()
        expected[1] = copy.deepcopy(module)  # shares no tensor (copy_of shares `step`)

        train(module, 2)  # the base is unchanged: its copy is skipped
        future = ckpt.save_async(tmp_path / "step2", module, {"step": 2})
        assert ckpt._stager.digests is not None and ckpt._stager.digests.vouched
        expected[2] = copy.deepcopy(module)
        base.data.mul_(-1.0)  # while step2 may still be writing: not in step2
        future.result()

        train(module, 3)  # the base differs (changed through .data): copied
        version = base._version
        base.data[3, 5] += 1.0
        assert base._version == version
        ckpt.save_async(tmp_path / "step3", module, {"step": 3}).result()
        expected[3] = copy.deepcopy(module)

        base.data.copy_(original)  # back to the bytes of step1 and step2's buffer
        ckpt.save_async(tmp_path / "step4", module, {"step": 4}).result()
        expected[4] = copy.deepcopy(module)

        ckpt.save(tmp_path / "step5", module, {"step": 5})  # sync: the live tensors
        ckpt.save_async(tmp_path / "step6", module, {"step": 6}).result()
        expected[6] = copy.deepcopy(module)
    finally:
        ckpt.close()
    assert linked(tmp_path / "step1", tmp_path / "step2")
    assert linked(tmp_path / "step5", tmp_path / "step6")
    reader = CheckpointerConfig(work_dir=tmp_path / "work2").build()
    try:
        for step, state in expected.items():
            dst = lora_module(seed=5)
            reader.load(tmp_path / f"step{step}", dst)
            assert_same_state(state, dst)
    finally:
        reader.close()
