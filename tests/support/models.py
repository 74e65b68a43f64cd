"""Small real models and optimizers for tests, with helpers to compare their state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from trainckpt import ModelAndOptim


class TinyNet(torch.nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, width)
        self.block = torch.nn.Sequential(
            torch.nn.Linear(width, 2 * width), torch.nn.GELU(), torch.nn.Linear(2 * width, width)
        )
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, 64, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.norm(h + self.block(h)))


def make_module(seed: int = 0, steps: int = 2, width: int = 32) -> ModelAndOptim:
    """A model and AdamW optimizer after `steps` real training steps (so moments exist)."""
    torch.manual_seed(seed)
    model = TinyNet(width)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        tokens = torch.randint(0, 64, (4, 8))
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        loss.backward()
        optim.step()
        optim.zero_grad()
    return ModelAndOptim(model, optim)


def fresh_module(seed: int = 123, width: int = 32) -> ModelAndOptim:
    """A different, untrained model + optimizer of the same shape, to load into."""
    return make_module(seed=seed, steps=0, width=width)


def assert_same_state(a: ModelAndOptim, b: ModelAndOptim, *, optim: bool = True) -> None:
    """Every model tensor equal; with `optim`, every optimizer state tensor and hyperparameter."""
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), f"model tensor {k} differs"
    if not optim:
        return
    assert a.optim is not None and b.optim is not None
    oa, ob = a.optim.state_dict(), b.optim.state_dict()
    assert oa["state"].keys() == ob["state"].keys()
    for pid in oa["state"]:
        for k, v in oa["state"][pid].items():
            assert torch.equal(v, ob["state"][pid][k]), f"optimizer state {pid}.{k} differs"
    assert [{k: v for k, v in g.items() if k != "params"} for g in oa["param_groups"]] == [
        {k: v for k, v in g.items() if k != "params"} for g in ob["param_groups"]
    ]


class WithExtra:
    """A TrainModule whose state holds one non-tensor value, `extra`, next to the model."""

    def __init__(self, extra: Any) -> None:
        self.inner = make_module()
        self.extra = extra
        self.loaded: dict[str, Any] | None = None

    def state_dict_to_save(self) -> dict[str, Any]:
        return {"model": self.inner.state_dict_to_save()["model"], "extra": self.extra}

    def state_dict_to_load(self, metadata: Any, optim: bool | None = None) -> dict[str, Any]:
        return {"model": fresh_module().state_dict_to_save()["model"], "extra": None}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict


def assert_plain_dcp_reads(path: Path, expected: ModelAndOptim) -> None:
    """Plain DCP (no process group) loads the model tensors of the trainckpt checkpoint at
    `path` bit-exactly as `expected` holds them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = str(path / "model_and_optim")
    md = FileSystemReader(folder).read_metadata()
    state = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in md.state_dict_metadata.items()
        if isinstance(v, TensorStorageMetadata)
    }
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    for name, value in expected.model.state_dict().items():
        assert torch.equal(state[f"model.{name}"], value), name
