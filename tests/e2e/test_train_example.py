"""The example run end to end: real `scripts/train.py` processes, killed for real, resumed, and
their final parameters compared bit for bit with an uninterrupted run."""

from __future__ import annotations

import re
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from support.example_run import Run, final_state, train, write_config

from trainckpt import Checkpointer

pytestmark = pytest.mark.slow

STEPS = 30


def assert_bit_identical(config: Path, a: Path, b: Path) -> None:
    (ma, oa, ta), (mb, ob, tb) = final_state(config, a), final_state(config, b)
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), f"parameter {k} differs between {a} and {b}"
    for pid, state in oa["state"].items():
        for k, v in state.items():
            assert torch.equal(v, ob["state"][pid][k]), f"optimizer {pid}.{k} differs"
    assert oa["param_groups"] == ob["param_groups"]
    assert ta["step"] == tb["step"] == STEPS
    assert torch.equal(ta["rng"], tb["rng"])
    assert torch.equal(ta["data"]["generator"], tb["data"]["generator"])
    assert ta["scheduler"] == tb["scheduler"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """An uninterrupted run of STEPS steps: (config, its final checkpoint)."""
    tmp = tmp_path_factory.mktemp("reference")
    config = write_config(tmp)
    out = train(config, tmp / "ckpts", STEPS)
    assert f"step {STEPS} loss" in out and "checkpoints in" in out
    # save_interval 20, ephemeral 5, max 2: permanent 20 and 30 (+ step 0), ephemerals replaced.
    kinds = {
        s: Checkpointer.read_metadata(p).ephemeral
        for s, p in Checkpointer.find_checkpoints(tmp / "ckpts")
    }
    assert kinds == {0: False, 20: False, 30: False}
    yield config, tmp / "ckpts" / f"step{STEPS}"


def _past_step10(config: Path, folder: Path) -> Run:
    """A run of the example, saving to `folder`, that has committed its ephemeral step 10."""
    run = Run(str(config), "--save-folder", str(folder), "--steps", str(STEPS))
    run.wait_for(r"checkpoint event: committed ephemeral '.*step10'")
    return run


def test_sigkill_mid_run_then_resume_is_bit_identical(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    config, ref_final = reference
    folder = tmp_path / "ckpts"
    run = _past_step10(config, folder)
    run.proc.send_signal(signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    assert f"step {STEPS} loss" not in run.output, "the run ended before it was killed"
    committed = [s for s, _ in Checkpointer.find_checkpoints(folder)]
    assert 10 in committed and max(committed) < STEPS

    resumed = Run(str(config), "--save-folder", str(folder), "--steps", str(STEPS))
    step = int(resumed.wait_for(r"resuming from '.*step(\d+)' \(step (\d+)\)").group(1))
    assert step == max(committed)
    assert resumed.finish() == 0, resumed.output
    assert_bit_identical(config, ref_final, folder / f"step{STEPS}")
    assert not list(folder.glob("*-tmp"))


def test_sigterm_saves_synchronously_then_resume_is_bit_identical(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    config, ref_final = reference
    folder = tmp_path / "ckpts"
    run = _past_step10(config, folder)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 128 + signal.SIGTERM, run.output
    m = re.search(r"SIGTERM: saved checkpoint '(.*step(\d+))' at step (\d+)", run.output)
    assert m, run.output
    path, step = Path(m.group(1)), int(m.group(2))
    assert 10 <= step < STEPS and int(m.group(3)) == step
    assert Checkpointer.latest_checkpoint(folder) == str(path)
    assert Checkpointer.read_metadata(path).ephemeral
    assert final_state(config, path)[2]["step"] == step

    resumed = Run(str(config), "--save-folder", str(folder), "--steps", str(STEPS))
    assert int(resumed.wait_for(r"resuming from '.*step(\d+)'").group(1)) == step
    assert resumed.finish() == 0, resumed.output
    assert_bit_identical(config, ref_final, folder / f"step{STEPS}")


def test_resume_from_the_pre_train_checkpoint_is_bit_identical(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """A run that died before its first checkpoint after step 0 resumes from step 0 with a fresh
    optimizer, as it was at step 0 (saving did not change it)."""
    config, ref_final = reference
    folder = tmp_path / "ckpts"
    shutil.copytree(ref_final.parent / "step0", folder / "step0")
    out = train(config, folder, STEPS)
    assert re.search(r"resuming from '.*step0' \(step 0\)", out), out
    assert_bit_identical(config, ref_final, folder / f"step{STEPS}")


def test_sigkill_then_resume_from_the_local_tier_is_bit_identical(
    reference: tuple[Path, Path], tmp_path: Path
) -> None:
    """configs/train-two-tiers.yaml's policy: local saves between the save-folder ones; killed
    after local step 12 committed (the save folder's newest is step 10), the run resumes from the
    local tier and ends exactly as the uninterrupted one."""
    _config, ref_final = reference
    config = write_config(tmp_path, local_save_interval=1)
    cfg = yaml.safe_load(config.read_text())
    cfg["checkpointer"]["local_dir"] = str(tmp_path / "local")
    config.write_text(yaml.safe_dump(cfg))
    folder = tmp_path / "ckpts"
    run = Run(str(config), "--save-folder", str(folder), "--steps", str(STEPS))
    run.wait_for(r"committed local checkpoint step 12 ")
    run.proc.send_signal(signal.SIGKILL)
    assert run.finish() == -signal.SIGKILL
    assert max(s for s, _ in Checkpointer.find_checkpoints(folder)) < 12 < STEPS

    resumed = Run(str(config), "--save-folder", str(folder), "--steps", str(STEPS))
    m = resumed.wait_for(r"resuming from '(.*)' \(step (\d+)\)")
    assert m.group(1).startswith(str(tmp_path / "local")) and int(m.group(2)) >= 12, m.group(0)
    assert resumed.finish() == 0, resumed.output
    assert_bit_identical(config, ref_final, folder / f"step{STEPS}")
