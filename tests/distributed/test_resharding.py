"""Resharding: FSDP2 checkpoints from 4 ranks load on 2 ranks and on 1 process, and back;
replicated (DDP) state is written once, with no empty shard files."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.multiproc import run_ranks

pytestmark = pytest.mark.slow

STEPS = 2


def _full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Unsharded model and flattened optimizer state (on every rank)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    full = {f"model.{k}": v for k, v in get_model_state_dict(model, options=opts).items()}
    for k, v in get_optimizer_state_dict(model, optim, options=opts).items():
        full[f"optim.{k}"] = v
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in full.items()}


def _module(sharded: bool, seed: int):
    from support.models import TinyNet
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from trainckpt import ModelAndOptim

    torch.manual_seed(seed)
    model = TinyNet()
    if sharded:
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        fully_shard(model.block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return ModelAndOptim(model, optim)


def _train(module, steps: int) -> None:
    torch.manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 8))
        out = module.model(tokens)
        torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens.flatten()).backward()
        module.optim.step()
        module.optim.zero_grad()


def _save(rank: int, world: int, folder: str, sharded: bool) -> dict:
    from trainckpt import CheckpointerConfig

    module = _module(sharded, seed=0)
    _train(module, STEPS)
    ckpt = CheckpointerConfig(work_dir=f"{folder}/w{rank}").build()
    ckpt.save(f"{folder}/step{STEPS}", module, {"saved_by": rank, "world": world})
    ckpt.close()
    return _full_state(module.model, module.optim)


def _load(rank: int, world: int, folder: str, sharded: bool) -> dict:
    from trainckpt import CheckpointerConfig

    module = _module(sharded, seed=99)
    _train(module, 1)  # different values, and optimizer state to overwrite
    ckpt = CheckpointerConfig(work_dir=f"{folder}/w{rank}").build()
    trainer = ckpt.load(f"{folder}/step{STEPS}", module)
    ckpt.close()
    return {"trainer": trainer, "state": _full_state(module.model, module.optim)}


def _single(fn, folder: str, sharded: bool) -> dict:
    return fn(0, 1, folder, sharded)


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_fsdp2_four_ranks_to_two_ranks_and_one_process(tmp_path: Path):
    saved = run_ranks(_save, 4, str(tmp_path), True)[0]
    names = sorted(p.name for p in (tmp_path / f"step{STEPS}" / "model_and_optim").iterdir())
    assert {n.split("_")[2] for n in names if n.endswith(".distcp")} == {"0", "1", "2", "3"}

    for res in run_ranks(_load, 2, str(tmp_path), True):
        _assert_equal(res["state"], saved)
        assert res["trainer"] == {"saved_by": 0, "world": 4}  # world size changed: rank 0's

    res = _single(_load, str(tmp_path), False)
    _assert_equal(res["state"], saved)


def test_one_process_to_four_fsdp2_ranks(tmp_path: Path):
    saved = _single(_save, str(tmp_path), False)
    for res in run_ranks(_load, 4, str(tmp_path), True):
        _assert_equal(res["state"], saved)
        assert res["trainer"] == {"saved_by": 0, "world": 1}


def _save_ddp(rank: int, world: int, folder: str) -> None:
    from support.models import make_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainckpt import CheckpointerConfig, ModelAndOptim

    m = make_module(seed=5)
    ckpt = CheckpointerConfig(work_dir=f"{folder}/w{rank}").build()
    ckpt.save(f"{folder}/ddp/step1", ModelAndOptim(DDP(m.model), m.optim), {"rank": rank})
    ckpt.close()


def test_replicated_state_is_written_once_without_empty_files(tmp_path: Path):
    from support.models import make_module

    from trainckpt import CheckpointerConfig

    run_ranks(_save_ddp, 2, str(tmp_path))
    single = make_module(seed=5)
    ckpt = CheckpointerConfig(work_dir=tmp_path / "w").build()
    ckpt.save(tmp_path / "one" / "step1", single, {"rank": 0})
    ckpt.close()

    def shard_bytes(step_dir: Path) -> list[int]:
        return [p.stat().st_size for p in (step_dir / "model_and_optim").glob("*.distcp")]

    ddp, one = shard_bytes(tmp_path / "ddp" / "step1"), shard_bytes(tmp_path / "one" / "step1")
    assert ddp and all(size > 0 for size in ddp)
    # Two replicas, one copy on disk: the same bytes as the single-process checkpoint (give or
    # take per-file framing), where writing every replica would double them.
    assert abs(sum(ddp) - sum(one)) < 0.1 * sum(one), (ddp, one)


def _save_and_load_local(rank: int, world: int, folder: str) -> dict:
    """FSDP2 state through the node-local tier: each rank's DTensor shards are saved as local
    tensors and copied back into a differently initialized FSDP2 module's DTensors."""
    from trainckpt import CheckpointerConfig

    module = _module(True, seed=0)
    _train(module, STEPS)
    saved = _full_state(module.model, module.optim)
    ckpt = CheckpointerConfig(local_dir=f"{folder}/local", work_dir=f"{folder}/w{rank}").build()
    ckpt.save_local(STEPS, module, {"rank": rank}).result()
    other = _module(True, seed=99)
    _train(other, 1)
    assert ckpt.latest_local() == STEPS
    trainer = ckpt.load_local(STEPS, other)
    ckpt.close()
    return {"saved": saved, "loaded": _full_state(other.model, other.optim), "trainer": trainer}


def test_fsdp2_state_round_trips_through_the_local_tier(tmp_path: Path):
    for rank, res in enumerate(run_ranks(_save_and_load_local, 2, str(tmp_path))):
        _assert_equal(res["saved"], res["loaded"])
        assert res["trainer"] == {"rank": rank}
