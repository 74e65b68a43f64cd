"""The example under `torchrun --nproc-per-node 2` (DDP on gloo): saves from both ranks, resumes,
and ends with the same parameters as an uninterrupted two-rank run."""

from __future__ import annotations

import re
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from support.example_run import Run, final_state, train, write_config

from trainckpt import Checkpointer

pytestmark = pytest.mark.slow

TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]


def test_torchrun_two_ranks_ddp_resumes_bit_identical(tmp_path: Path) -> None:
    config = write_config(tmp_path, fixed_steps=[8])
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    out = train(config, straight, 14, launcher=TORCHRUN)
    assert "on 2 rank(s)" in out
    step8 = straight / "step8"
    assert sorted(p.name for p in (step8 / "train").iterdir()) == ["rank0.pt", "rank1.pt"]
    # Resume a second two-rank job from the straight run's step 8 (as if it had died there).
    shutil.copytree(step8, resumed / "step8")
    out = train(config, resumed, 14, launcher=TORCHRUN)
    assert re.search(r"resuming from '.*step8' \(step 8\)", out), out
    (ma, oa, ta), (mb, ob, tb) = (
        final_state(config, straight / "step14"),
        final_state(config, resumed / "step14"),
    )
    assert ta["world_size"] == tb["world_size"] == 2 and ta["step"] == tb["step"] == 14
    for k in ma:
        assert torch.equal(ma[k], mb[k]), f"parameter {k} differs"
    for pid, state in oa["state"].items():
        for k, v in state.items():
            assert torch.equal(v, ob["state"][pid][k]), f"optimizer {pid}.{k} differs"


def test_sigterm_to_torchrun_both_ranks_save_the_same_step(tmp_path: Path) -> None:
    """torchrun forwards SIGTERM to its workers, which may see it at different steps: they
    agree on one step, save it together and exit."""
    config, folder = write_config(tmp_path), tmp_path / "ckpts"
    run = Run(str(config), "--save-folder", str(folder), "--steps", "500", launcher=TORCHRUN)
    run.wait_for(r"checkpoint event: committed ephemeral '.*step10'")
    run.proc.send_signal(signal.SIGTERM)
    run.finish()  # torchrun itself reports the signal with a non-zero status
    saved = re.findall(
        r"\[rank(\d)\] train: SIGTERM: saved checkpoint '(.*)' at step (\d+)", run.output
    )
    assert sorted(r for r, _, _ in saved) == ["0", "1"], run.output
    assert len({(path, step) for _, path, step in saved}) == 1
    path = Path(saved[0][1])
    assert str(path) == Checkpointer.latest_checkpoint(folder)
    assert Checkpointer.read_metadata(path).ephemeral
    assert sorted(p.name for p in (path / "train").iterdir()) == ["rank0.pt", "rank1.pt"]
    assert final_state(config, path)[2]["step"] == int(saved[0][2])
