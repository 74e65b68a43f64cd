"""Checkpoints interchange with AllenAI OLMo-core's Checkpointer, both ways."""

from __future__ import annotations

# Part of the `test` extra: a missing OLMo-core fails this file instead of skipping it.
import olmo_core.train.checkpoint as olmo_checkpoint
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import Checkpointer, CheckpointerConfig


def test_trainckpt_finds_and_loads_olmo_checkpoints(tmp_path):
    olmo = olmo_checkpoint.Checkpointer(work_dir=tmp_path / "olmo-work")
    src = make_module(seed=11)
    olmo.save(str(tmp_path / "run" / "step10"), src, {"global_step": 10}, ephemeral=True)
    olmo.save(str(tmp_path / "run" / "step20"), src, {"global_step": 20})

    run = tmp_path / "run"
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [10, 20]
    assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=True)] == [10]
    latest = Checkpointer.latest_checkpoint(run)
    assert Checkpointer.read_metadata(latest).ephemeral is False

    ckpt = CheckpointerConfig(work_dir=tmp_path / "w").build()
    dst = fresh_module()
    state = ckpt.load(latest, dst)
    assert state == {"global_step": 20}
    assert_same_state(src, dst)
    ckpt.close()


def test_olmo_finds_and_loads_trainckpt_checkpoints(tmp_path):
    ckpt = CheckpointerConfig(work_dir=tmp_path / "w").build()
    src = make_module(seed=12)
    ckpt.save(tmp_path / "run" / "step5", src, {"global_step": 5}, ephemeral=True)
    ckpt.save(tmp_path / "run" / "step9", src, {"global_step": 9})
    ckpt.close()

    olmo = olmo_checkpoint.Checkpointer
    run = str(tmp_path / "run")
    assert sorted(s for s, _ in olmo.find_checkpoints(run)) == [5, 9]
    assert [s for s, _ in olmo.find_checkpoints(run, ephemeral=True)] == [5]
    assert [s for s, _ in olmo.find_checkpoints(run, ephemeral=False)] == [9]
    assert olmo.latest_checkpoint(run).endswith("step9")

    dst = fresh_module()
    state = olmo(work_dir=tmp_path / "olmo-work").load(f"{run}/step9", dst)
    assert state == {"global_step": 9}
    assert_same_state(src, dst)
