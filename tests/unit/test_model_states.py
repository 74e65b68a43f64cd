"""`ModelAndStates`: model parts plus any Stateful objects, in torchtitan's DCP layout, without
torchtitan: parts, flattened optimizer state, exclude, per-rank state, vetted pickles, and the
policy driver's overlapped staging and model-only final save with it."""

from __future__ import annotations

import logging
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from support.models import TinyNet
from support.multiproc import run_ranks
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from trainckpt import (
    CheckpointerConfig,
    CheckpointManager,
    CheckpointPolicy,
    ConfigurationError,
    ModelAndStates,
    UnsafeCheckpointError,
)
from trainckpt.format.dcp_metadata import read_dcp_metadata
from trainckpt.storage import resolve

_FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


class FlatOptim:
    """An optimizer container as torchtitan's: one optimizer per part, state flattened by
    parameter name (DCP's own flattening here), so parts never collide."""

    def __init__(self, parts: list[torch.nn.Module], lr: float = 1e-2) -> None:
        self.parts = parts
        self.optims = [torch.optim.AdamW(p.parameters(), lr=lr) for p in parts]

    def step(self) -> None:
        for o in self.optims:
            o.step()
            o.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for p, o in zip(self.parts, self.optims, strict=True):
            out.update(get_optimizer_state_dict(p, o, options=_FLAT))
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        for p, o in zip(self.parts, self.optims, strict=True):
            own = get_optimizer_state_dict(p, o, options=_FLAT).keys()
            set_optimizer_state_dict(p, o, {k: sd[k] for k in own}, options=_FLAT)


class Counter:
    """Plain trainer state (torchtitan's `train_state`)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.step = sd["step"]


class PickledPosition:
    """Keeps its state as pickled bytes and unpickles them on load, as torchtitan's data
    loader does (`pickle.dumps` / `pickle.loads`)."""

    def __init__(self, pos: int = 0) -> None:
        self.pos = pos

    def state_dict(self) -> dict[str, Any]:
        return {"dp_rank_0": pickle.dumps({"pos": self.pos}), "world_size": 1}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.pos = pickle.loads(sd["dp_rank_0"])["pos"]


def _stages(seed: int) -> list[torch.nn.Module]:
    torch.manual_seed(seed)
    first, second = TinyNet(), TinyNet()
    second.load_state_dict(first.state_dict())
    del first.norm, first.head
    del second.embed, second.block
    return [first, second]


def _run(parts: list[torch.nn.Module], optim: FlatOptim, steps: int) -> None:
    first, second = parts
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 8))
        h = first.embed(tokens)
        out = second.head(second.norm(h + first.block(h)))
        torch.nn.functional.cross_entropy(out.flatten(0, 1), tokens.flatten()).backward()
        optim.step()


def _build(seed: int, steps: int) -> tuple[ModelAndStates, FlatOptim, Counter, PickledPosition]:
    parts = _stages(seed)
    optim = FlatOptim(parts)
    _run(parts, optim, steps)
    counter, pos = Counter(), PickledPosition(steps * 4)
    counter.step = steps
    module = ModelAndStates(
        parts, {"optimizer": optim, "train_state": counter, "dataloader": pos, "missing": None}
    )
    return module, optim, counter, pos


def _assert_same(a: ModelAndStates, b: ModelAndStates, *, optim: bool = True) -> None:
    ma, mb = a.model_state(), b.model_state()
    assert ma.keys() == mb.keys()
    for k in ma:
        assert torch.equal(ma[k], mb[k]), k
    if optim:
        oa, ob = a.states["optimizer"].state_dict(), b.states["optimizer"].state_dict()
        assert oa.keys() == ob.keys()
        for k in oa:
            if isinstance(oa[k], torch.Tensor):
                assert torch.equal(oa[k], ob[k]), k
            else:
                assert oa[k] == ob[k], k


def test_layout_is_torchtitans_and_roundtrips(ckpt, tmp_path):
    src, _, _, _ = _build(0, steps=3)
    path = ckpt.save(tmp_path / "step3", src, {})
    storage, folder = resolve(path + "/model_and_optim")
    keys = set(read_dcp_metadata(storage, folder).state_dict_metadata)
    # model keys at the top level, merged across the two parts; states under their names
    assert {"embed.weight", "block.0.weight", "head.weight", "norm.weight"} <= keys
    assert "train_state.step" in keys and "dataloader.dp_rank_0" in keys
    assert any(k.startswith("optimizer.state.") and k.endswith("exp_avg") for k in keys)
    assert not any(k.startswith("model.") for k in keys)
    assert "missing" in keys  # a None state is saved as None, as torchtitan's manager saves it

    dst, _, counter, pos = _build(7, steps=0)
    ckpt.load(path, dst)
    _assert_same(src, dst)
    assert (counter.step, pos.pos) == (3, 12)

    # into one part: a checkpoint of two stages loads into the whole model's split
    whole = TinyNet()
    ckpt.load(path, ModelAndStates(whole, {}), load_trainer_state=False)
    merged = src.model_state()
    for k, v in whole.state_dict().items():
        assert torch.equal(v, merged[k]), k


def test_exclude_and_model_only_loads_leave_states_alone(ckpt, tmp_path):
    src, _, _, _ = _build(0, steps=2)
    path = ckpt.save(tmp_path / "step2", src, {})
    dst, optim, counter, pos = _build(5, steps=1)
    before = {k: v.clone() for k, v in optim.state_dict().items() if isinstance(v, torch.Tensor)}
    ckpt.load(path, dst, exclude=["dataloader"], load_optim_state=False)
    _assert_same(src, dst, optim=False)
    assert (counter.step, pos.pos) == (2, 4)  # train_state loaded; dataloader untouched
    after = optim.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # optimizer untouched


def test_state_missing_from_checkpoint_is_left_with_a_warning(ckpt, tmp_path, caplog):
    parts = _stages(0)
    path = ckpt.save(tmp_path / "step0", ModelAndStates(parts, {}), {})
    dst, _, counter, _ = _build(3, steps=1)
    with caplog.at_level(logging.WARNING, logger="trainckpt"):
        ckpt.load(path, dst)  # a seed checkpoint: model only
    assert counter.step == 1
    assert "no 'train_state' state" in caplog.text
    with pytest.raises(Exception, match="holds no 'optimizer' state"):
        ckpt.load(tmp_path / "step0", dst, load_optim_state=True)


def test_names_are_checked(tmp_path):
    parts = _stages(0)
    with pytest.raises(ConfigurationError, match="collides with the model's keys"):
        ModelAndStates(parts, {"embed": Counter()})
    with pytest.raises(ConfigurationError, match="unique across parts"):
        ModelAndStates([TinyNet(), TinyNet()])
    with pytest.raises(ConfigurationError, match="no state_dict/load_state_dict"):
        ModelAndStates(parts, {"x": object()})  # type: ignore[dict-item]
    with pytest.raises(ConfigurationError, match="per_rank"):
        ModelAndStates(parts, {"a": Counter()}, per_rank=["b"])


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "ran"))


class _EvilPosition(PickledPosition):
    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    def state_dict(self) -> dict[str, Any]:
        return {"dp_rank_0": pickle.dumps({"pos": _Evil(self.marker)}), "world_size": 1}


def test_pickled_bytes_that_would_run_code_are_refused(ckpt, tmp_path):
    marker = tmp_path / "marker"
    parts = _stages(0)
    path = ckpt.save(
        tmp_path / "step1", ModelAndStates(parts, {"dataloader": _EvilPosition(str(marker))}), {}
    )
    assert not marker.exists()
    victim = PickledPosition(9)
    with pytest.raises(UnsafeCheckpointError, match="dataloader.dp_rank_0"):
        ckpt.load(path, ModelAndStates(_stages(1), {"dataloader": victim}))
    assert not marker.exists() and victim.pos == 9


def _per_rank_save(rank: int, world: int, folder: str) -> None:
    c = CheckpointerConfig(work_dir=Path(folder) / f"work{rank}").build()
    counter = Counter()
    counter.step = 100 + rank  # same keys on every rank, different values
    torch.manual_seed(0)
    model = TinyNet()
    c.save(f"{folder}/step5", ModelAndStates(model, {"rng": counter}, per_rank=["rng"]), {})
    c.close()


def test_per_rank_state_keeps_every_ranks_value(ckpt, tmp_path, caplog):
    run_ranks(_per_rank_save, 2, str(tmp_path))
    for rank, expected in ((0, 100), (1, 101)):
        counter = Counter()
        ckpt.load(
            tmp_path / "step5",
            ModelAndStates(TinyNet(), {"rng": counter}, per_rank=["rng"], rank=rank),
        )
        assert counter.step == expected
    counter = Counter()
    with caplog.at_level(logging.WARNING, logger="trainckpt"):
        ckpt.load(
            tmp_path / "step5",
            ModelAndStates(TinyNet(), {"rng": counter}, per_rank=["rng"], rank=3),
        )
    assert counter.step == 100 and "loading rank 0's" in caplog.text


def test_policy_overlapped_staging_and_model_only_final_save(ckpt, tmp_path):
    policy = CheckpointPolicy(
        save_interval=2,
        pre_train_checkpoint=False,
        overlap_staging=True,
        final_save="model_only",
        final_dtype="bfloat16",
    )
    module, optim, counter, _ = _build(0, steps=0)
    driver = CheckpointManager(ckpt, policy, tmp_path / "run")
    for step in range(1, 5):
        _run(module.parts, optim, 1)
        counter.step = step
        if driver.maybe_save(step, module, {}) is not None:
            expected = {k: v.clone() for k, v in module.model_state().items()}
            driver.wait_for_staging()  # before the step that changes the parameters
            _run(module.parts, optim, 1)  # changes parameters while the save is written
            driver.checkpointer.wait()
            loaded, _, _, _ = _build(9, steps=0)
            ckpt.load(tmp_path / "run" / f"step{step}", loaded)
            for k, v in loaded.model_state().items():
                assert torch.equal(v, expected[k]), k
    driver.wait_for_staging()  # nothing staging: returns at once
    final = driver.save_final(5, module, {})
    driver.finish()
    storage, folder = resolve(final + "/model_and_optim")
    md = read_dcp_metadata(storage, folder).state_dict_metadata
    assert "head.weight" in md and not any(k.startswith("optimizer") for k in md)
    assert md["head.weight"].properties.dtype == torch.bfloat16

    with pytest.raises(Exception, match="overlap_staging=True applies only"):
        CheckpointPolicy(save_async=False, overlap_staging=True)
