"""The example under `torchrun --nproc-per-node 2` (DDP on gloo): saves from both ranks, resumes,
and ends with the same parameters as an uninterrupted two-rank run."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from example_run import final_state, train, write_config

pytestmark = pytest.mark.slow


def test_torchrun_two_ranks_ddp_resumes_bit_identical(tmp_path: Path) -> None:
    torchrun = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    config = write_config(tmp_path, fixed_steps=[8])
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    out = train(config, straight, 14, launcher=torchrun)
    assert "on 2 rank(s)" in out
    step8 = straight / "step8"
    assert sorted(p.name for p in (step8 / "train").iterdir()) == ["rank0.pt", "rank1.pt"]
    # Resume a second two-rank job from the straight run's step 8 (as if it had died there).
    shutil.copytree(step8, resumed / "step8")
    out = train(config, resumed, 14, launcher=torchrun)
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
