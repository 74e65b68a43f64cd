"""Hugging Face safetensors with torchtitan's llama3 adapter, against torchtitan's own manager and
trainckpt's: final save (`last_save_in_hf`, sharded with an index) and initial load
(`initial_load_in_hf`, `initial_load_path`), on CPU with real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support import titan_run as tr

from trainckpt import Checkpointer, CorruptCheckpointError

KINDS = ["torchtitan", "trainckpt"]


pytestmark = pytest.mark.usefixtures("single_rank")  # conftest.py: a gloo group of one rank


def _llama_names() -> set[str]:
    """The key names of a Hugging Face `LlamaForCausalLM` of this size."""
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    for i in range(tr.LAYERS):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names.add(f"model.layers.{i}.self_attn.{proj}.weight")
        for proj in ("gate_proj", "up_proj", "down_proj"):
            names.add(f"model.layers.{i}.mlp.{proj}.weight")
        names.add(f"model.layers.{i}.input_layernorm.weight")
        names.add(f"model.layers.{i}.post_attention_layernorm.weight")
    return names


@pytest.fixture
def hf_assets(tmp_path: Path) -> Path:
    """A model's Hugging Face assets folder with its index: two shards, as a released model
    has them (the layers of 0 in the first file, everything else in the second)."""
    folder = tmp_path / "assets"
    folder.mkdir()
    weight_map = {
        n: "model-00001-of-00002.safetensors"
        if n.startswith(("model.embed_tokens", "model.layers.0."))
        else "model-00002-of-00002.safetensors"
        for n in _llama_names()
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def _read_hf(folder: Path) -> dict[str, torch.Tensor]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    out: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(folder / name)))
    assert set(index["weight_map"]) == set(out)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_final_save_in_hf_sharded_with_index(kind, tmp_path, hf_assets):
    folder = tmp_path / "ckpt"
    run = tr.build(3, hf_assets_path=str(hf_assets))
    ckpt = tr.manager(kind, run, folder, interval=10, last_save_in_hf=True, export_dtype="bfloat16")
    tr.train(run, ckpt)
    ckpt.close()
    step = folder / "step-3"
    shards = sorted(p.name for p in step.glob("*.safetensors"))
    assert shards == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    hf = _read_hf(step)
    assert set(hf) == _llama_names()
    assert set(load_file(str(step / shards[0]))) == {
        n for n in _llama_names() if n.startswith(("model.embed_tokens", "model.layers.0."))
    }
    expected = run.adapter.to_hf(
        {k: v.to(torch.bfloat16) for k, v in run.model.state_dict().items()}
    )
    for k, v in expected.items():
        assert hf[k].dtype == torch.bfloat16 and torch.equal(hf[k], v), k
    if kind == "trainckpt":
        assert Checkpointer.verify(step, deep=True).ok  # committed like any checkpoint


@pytest.mark.parametrize("kind", KINDS)
def test_initial_load_in_hf_reproduces_the_weights(kind, tmp_path, hf_assets):
    source = tr.build(3, seed=5)
    hf = source.adapter.to_hf(source.model.state_dict())
    released = tmp_path / "released"
    released.mkdir()
    save_file({k: v.contiguous() for k, v in hf.items()}, str(released / "model.safetensors"))
    (released / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {k: "model.safetensors" for k in hf}})
    )
    run = tr.build(3, seed=6)
    ckpt = tr.manager(
        kind,
        run,
        tmp_path / "ckpt",
        interval=10,
        initial_load_path=str(released),
        initial_load_in_hf=True,
    )
    assert ckpt.load(step=-1)
    ckpt.close()
    for k, v in source.model.state_dict().items():
        assert torch.equal(run.model.state_dict()[k], v), k
    assert not run.optimizers.optimizers[0].state  # model only


def test_hf_round_trip_and_resume_from_an_hf_final_save(tmp_path, hf_assets):
    folder = tmp_path / "ckpt"
    run = tr.build(3, hf_assets_path=str(hf_assets))
    ckpt = tr.manager("trainckpt", run, folder, interval=2, keep_latest_k=0, last_save_in_hf=True)
    tr.train(run, ckpt)
    ckpt.close()
    # a new job in the same folder: the newest checkpoint is the HF final save, model only
    again = tr.build(3, seed=7, hf_assets_path=str(hf_assets))
    ckpt = tr.manager("trainckpt", again, folder, interval=2, keep_latest_k=0)
    assert ckpt.load(step=-1)
    ckpt.close()
    for k, v in run.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[k], v), k


def test_an_index_naming_files_outside_the_folder_is_refused(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}})
    )
    run = tr.build(3)
    ckpt = tr.manager(
        "trainckpt", run, tmp_path / "ckpt", initial_load_path=str(bad), initial_load_in_hf=True
    )
    with pytest.raises(CorruptCheckpointError, match="outside the folder"):
        ckpt.load()
    ckpt.close()
