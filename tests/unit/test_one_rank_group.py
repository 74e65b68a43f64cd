"""A job of one rank under `torchrun` has a process group of one rank. trainckpt then runs DCP
without its collectives (on one rank they only pickled every plan and result): what it writes
must still be a complete checkpoint, for trainckpt and for plain DCP, save after save, through
every writer, and across a change of the state's shapes (a new plan)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist
from support.models import assert_plain_dcp_reads, assert_same_state, fresh_module, make_module

from trainckpt import CheckpointerConfig


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_saves_in_a_one_rank_group_are_whole_for_trainckpt_and_plain_dcp(
    one_rank: None, tmp_path: Path, writer: str
) -> None:
    assert dist.is_initialized() and dist.get_world_size() == 1
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", async_writer=writer).build()
    try:
        # same shapes twice (the plan and its write results reused), then other shapes
        for n, (seed, width) in enumerate([(1, 32), (2, 32), (3, 48)], start=1):
            module = make_module(seed=seed, width=width)
            path = tmp_path / f"step{n}"
            if n % 2:
                ckpt.save(path, module, {"step": n})
            else:
                ckpt.save_async(path, module, {"step": n}).result()
            dst = fresh_module(width=width)
            assert ckpt.load(path, dst) == {"step": n}
            assert_same_state(module, dst)
            assert_plain_dcp_reads(path, module)
    finally:
        ckpt.close()
