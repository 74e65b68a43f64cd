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


def _groups_after_close(rank: int, world: int, folder: str) -> dict:
    import torch.distributed as dist
    from support.models import make_module

    from trainckpt import CheckpointerConfig

    def groups() -> int:
        return len(dist.distributed_c10d._world.pg_map)

    before = groups()
    own = CheckpointerConfig(work_dir=f"{folder}/work{rank}").build()
    created = groups() - before
    own.save(f"{folder}/step1", make_module(), {"rank": rank})
    own.close()
    after_own = groups()
    theirs = dist.new_group(backend="gloo")
    passed = CheckpointerConfig(work_dir=f"{folder}/work{rank}").build(process_group=theirs)
    passed.close()
    return {
        "created": created,
        "left_after_close": after_own - before,
        "own_dropped": own.process_group is None,
        "passed_kept": passed.process_group is theirs
        and theirs in dist.distributed_c10d._world.pg_map,
    }


def test_close_destroys_the_group_the_checkpointer_created(tmp_path: Path):
    """`close()` destroys the gloo group the checkpointer made (its threads stop while the
    interpreter is alive, not at exit, where they can abort the process) and keeps a group
    the caller passed in."""
    for result in run_ranks(_groups_after_close, 2, str(tmp_path)):
        assert result == {
            "created": 1,
            "left_after_close": 0,
            "own_dropped": True,
            "passed_kept": True,
        }
