"""Trainer integration: model parts, exclude, seed checkpoints, overlapped staging, weights-only
final checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.models import TinyNet, assert_same_state, make_module
from support.multiproc import run_ranks

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    ConfigurationError,
    ModelAndOptim,
    ModelWeights,
)


def _two_stages(seed: int) -> ModelAndOptim:
    """TinyNet split into two pipeline stages that keep the original parameter names."""
    torch.manual_seed(seed)
    first, second = TinyNet(), TinyNet()
    second.load_state_dict(first.state_dict())
    del first.norm, first.head
    del second.embed, second.block
    optims = [torch.optim.AdamW(p.parameters(), lr=1e-2) for p in (first, second)]
    return ModelAndOptim([first, second], optims)


def _train_stages(m: ModelAndOptim, steps: int = 2) -> None:
    first, second = m.parts
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 8))
        h = first.embed(tokens)
        h = h + first.block(h)
        out = second.head(second.norm(h))
        torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens.flatten()).backward()
        for o in m.optims:
            o.step()
            o.zero_grad()


def _named_optim_state(parts, optims) -> dict[str, torch.Tensor]:
    out = {}
    for part, optim in zip(parts, optims, strict=True):
        names = {id(p): n for n, p in part.named_parameters()}
        for p, st in optim.state.items():
            for k, v in st.items():
                out[f"{names[id(p)]}.{k}"] = v
    return out


def test_two_parts_round_trip_and_load_into_one_part(ckpt, tmp_path):
    src = _two_stages(seed=1)
    _train_stages(src)
    path = ckpt.save(tmp_path / "step2", src, {"step": 2})

    dst = _two_stages(seed=2)
    _train_stages(dst, steps=1)
    ckpt.load(path, dst)
    for a, b in zip(src.parts, dst.parts, strict=True):
        assert_same_state(ModelAndOptim(a), ModelAndOptim(b), optim=False)
    assert (
        _named_optim_state(src.parts, src.optims).keys()
        == _named_optim_state(dst.parts, dst.optims).keys()
    )
    for k, v in _named_optim_state(src.parts, src.optims).items():
        assert torch.equal(v, _named_optim_state(dst.parts, dst.optims)[k]), k

    whole = make_module(seed=3, steps=1)  # same architecture, one part, one optimizer
    ckpt.load(path, whole)
    merged = {**src.parts[0].state_dict(), **src.parts[1].state_dict()}
    assert merged.keys() == whole.model.state_dict().keys()
    for k, v in whole.model.state_dict().items():
        assert torch.equal(v, merged[k]), k
    src_optim = _named_optim_state(src.parts, src.optims)
    for k, v in _named_optim_state([whole.model], [whole.optim]).items():
        assert torch.equal(v, src_optim[k]), k


def test_colliding_part_names_are_refused():
    a, b = TinyNet(), TinyNet()
    with pytest.raises(ConfigurationError, match="unique across parts"):
        ModelAndOptim([a, b])


def test_exclude_leaves_named_state_untouched(ckpt, tmp_path):
    src = make_module(seed=1)
    path = ckpt.save(tmp_path / "step1", src, {"step": 1, "data_position": 1234})
    dst = make_module(seed=2)
    optim_before = {k: v.clone() for k, v in dst.optim.state_dict()["state"][0].items()}
    state = ckpt.load(path, dst, exclude=["optim", "data_position"])
    assert state == {"step": 1}
    assert_same_state(src, dst, optim=False)
    for k, v in dst.optim.state_dict()["state"][0].items():
        assert torch.equal(v, optim_before[k]), k

    with pytest.raises(ConfigurationError, match=r"data_pos.*known top-level keys.*'model'"):
        ckpt.load(path, dst, exclude=["data_pos"])


def test_overlapped_staging_holds_values_from_the_call(ckpt, tmp_path):
    module = make_module(seed=4)
    expected = {k: v.clone() for k, v in module.model.state_dict().items()}
    fut = ckpt.save_async(tmp_path / "step1", module, {"step": 1}, overlap_staging=True)
    ckpt.wait_for_staging()
    with torch.no_grad():
        for p in module.model.parameters():
            p.mul_(-3.0)
    fut.result()
    dst = make_module(seed=5)
    ckpt.load(tmp_path / "step1", dst, load_optim_state=False)
    for k, v in dst.model.state_dict().items():
        assert torch.equal(v, expected[k]), k
    ckpt.wait_for_staging()  # nothing staging: returns at once


def test_weights_only_bfloat16_final_checkpoint(ckpt, tmp_path):
    src = make_module(seed=6)
    full = Path(ckpt.save(tmp_path / "step9", src, {"step": 9}))
    final = Path(ckpt.save(tmp_path / "step10", ModelWeights(src, torch.bfloat16), {"step": 10}))

    def size(p: Path) -> int:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())

    assert size(final) < size(full) / 2
    assert Checkpointer.latest_checkpoint(tmp_path) == str(final)
    torch.manual_seed(0)
    bf16 = ModelAndOptim(TinyNet().to(torch.bfloat16))
    assert ckpt.load(final, bf16) == {"step": 10}
    for k, v in bf16.model.state_dict().items():
        assert v.dtype == torch.bfloat16
        assert torch.equal(v, src.model.state_dict()[k].to(torch.bfloat16)), k


def _load_seed_fsdp(rank: int, world: int, seed_dir: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(100 + rank)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ckpt = CheckpointerConfig(work_dir=f"{seed_dir}-w{rank}").build()
    state = ckpt.load(seed_dir, ModelAndOptim(model, optim))
    ckpt.close()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "trainer": state,
        "model": {k: v.clone() for k, v in full.items()},
        "optim": len(optim.state),
    }


@pytest.mark.slow
def test_seed_checkpoint_from_one_process_loads_into_two_fsdp_ranks(ckpt, tmp_path):
    torch.manual_seed(7)
    seed_model = TinyNet()
    seed_dir = ckpt.save(tmp_path / "step0", ModelAndOptim(seed_model), {"step": 0})
    for res in run_ranks(_load_seed_fsdp, 2, seed_dir):
        assert res["trainer"] == {"step": 0}
        assert res["optim"] == 0  # a seed checkpoint loads model weights only
        for k, v in seed_model.state_dict().items():
            assert torch.equal(res["model"][k], v), k


def test_step0_checkpoint_loads_model_weights_only_by_default(ckpt, tmp_path):
    src = make_module(seed=8)
    seed = ckpt.save(tmp_path / "step0", src, {"step": 0})
    dst = make_module(seed=9)
    optim_before = {k: v.clone() for k, v in dst.optim.state_dict()["state"][0].items()}
    ckpt.load(seed, dst)
    assert_same_state(src, dst, optim=False)
    for k, v in dst.optim.state_dict()["state"][0].items():
        assert torch.equal(v, optim_before[k]), k
    ckpt.load(seed, dst, load_optim_state=True)  # asked for explicitly: loaded
    assert_same_state(src, dst)


def test_policy_final_save_model_only_bfloat16(ckpt, tmp_path):
    from trainckpt import CheckpointManager, CheckpointPolicy

    policy = CheckpointPolicy(
        save_interval=5, save_async=False, final_save="model_only", final_dtype="bfloat16"
    )
    module = make_module(seed=10)
    driver = CheckpointManager(ckpt, policy, tmp_path / "run")
    driver.maybe_save(5, module, {"step": 5})
    final = driver.save_final(7, module, {"step": 7})
    driver.finish()

    assert Checkpointer.latest_checkpoint(tmp_path / "run") == final
    assert Checkpointer.read_metadata(final).ephemeral is False
    bf16 = ModelAndOptim(TinyNet().to(torch.bfloat16))
    assert ckpt.load(final, bf16) == {"step": 7}
    for k, v in bf16.model.state_dict().items():
        assert torch.equal(v, module.model.state_dict()[k].to(torch.bfloat16)), k
    with pytest.raises(ConfigurationError, match="final_dtype"):
        CheckpointPolicy.validated({"final_dtype": "bfloat16"})


def test_saving_does_not_change_a_fresh_optimizer(ckpt, tmp_path):
    def run(save_first: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = TinyNet()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if save_first:  # a pre-train (step 0) checkpoint
            ckpt.save(tmp_path / "step0", ModelAndOptim(model, optim), {"step": 0})
        assert not optim.state
        tokens = torch.randint(0, 64, (4, 8))
        torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
        optim.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    with_save, without = run(True), run(False)
    for k, v in without.items():
        assert torch.equal(with_save[k], v), k


@pytest.mark.parametrize("plain", [True, False], ids=["plain_walk", "dcp"])
def test_a_load_builds_each_parts_state_dict_once(ckpt, tmp_path, monkeypatch, plain):
    """`load_state_dict` of the state `state_dict_to_load` handed out splits it by part with
    the keys it handed out (a plain walk or DCP's `get_state_dict` per part walks every
    entry: once per load, not twice); any other state dict is still split by each part's own
    keys."""
    from trainckpt import plain_state, train_module

    src = _two_stages(seed=1)
    _train_stages(src)
    path = ckpt.save(tmp_path / "step2", src, {"step": 2})
    calls: list[str] = []
    real_walk = plain_state.walk
    monkeypatch.setattr(
        plain_state,
        "walk",
        lambda m: calls.append("walk") or (real_walk(m) if plain else "forced"),
    )
    for name in ("get_model_state_dict", "get_optimizer_state_dict", "get_state_dict"):
        real = getattr(train_module, name)
        monkeypatch.setattr(
            train_module,
            name,
            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k),
        )
    dst = _two_stages(seed=2)
    ckpt.load(path, dst)
    assert calls == (["walk"] * 2 if plain else ["walk", "get_state_dict"] * 2)
    for k, v in _named_optim_state(src.parts, src.optims).items():
        assert torch.equal(v, _named_optim_state(dst.parts, dst.optims)[k]), k

    other = _two_stages(seed=3)
    saved = src.state_dict_to_save()
    other.load_state_dict({"model": dict(saved["model"]), "optim": dict(saved["optim"])})
    for a, b in zip(src.parts, other.parts, strict=True):
        assert_same_state(ModelAndOptim(a), ModelAndOptim(b), optim=False)
    for k, v in _named_optim_state(src.parts, src.optims).items():
        assert torch.equal(v, _named_optim_state(other.parts, other.optims)[k]), k
