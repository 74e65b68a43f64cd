"""Two real ranks (gloo) saving to and loading from one shared folder, sync and async."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.multiproc import run_ranks

pytestmark = pytest.mark.slow


def _save_and_load(rank: int, world: int, folder: str) -> dict:
    from support.models import assert_same_state, fresh_module, make_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainckpt import Checkpointer, CheckpointerConfig, ModelAndOptim

    ckpt = CheckpointerConfig(work_dir=f"{folder}/work{rank}", fs_timeout=30).build()
    src = make_module(seed=7)  # same seed: replicated weights, as DDP keeps them
    src = ModelAndOptim(DDP(src.model), src.optim)
    state = {"rank": rank, "rng": torch.get_rng_state()}

    sync_path = ckpt.save(f"{folder}/step1", src, state)
    fut = ckpt.save_async(f"{folder}/step2", src, {**state, "async": True}, ephemeral=True)
    with torch.no_grad():  # training goes on while the async save writes
        for p in src.model.parameters():
            p.mul_(0.0)
    async_path = fut.result()

    results = {}
    for path in (sync_path, async_path):
        dst = fresh_module()
        dst = ModelAndOptim(DDP(dst.model), dst.optim)
        results[path] = ckpt.load(path, dst)
        reference = make_module(seed=7)
        assert_same_state(ModelAndOptim(DDP(reference.model), reference.optim), dst)
    found = list(Checkpointer.find_checkpoints(folder))
    ckpt.close()
    return {"paths": (sync_path, async_path), "trainer": results, "found": found}


def test_two_ranks_sync_and_async(tmp_path: Path):
    results = run_ranks(_save_and_load, 2, str(tmp_path))
    for rank, res in enumerate(results):
        sync_path, async_path = res["paths"]
        assert res["trainer"][sync_path]["rank"] == rank
        assert res["trainer"][async_path]["async"] is True
        assert [s for s, _ in res["found"]] == [1, 2]
    step1 = tmp_path / "step1"
    assert (step1 / "train" / "rank0.pt").is_file() and (step1 / "train" / "rank1.pt").is_file()
    assert not list(tmp_path.glob("*-tmp"))
