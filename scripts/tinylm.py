"""The example's tiny decoder-only language model and its deterministic synthetic data.

Example code for `scripts/train.py`, not part of the library. Everything here is reproducible
from a seed, and the data stream's position is part of its `state_dict`, so a resumed run
sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import nn


class ModelConfig(BaseModel):
    """Shape of the transformer."""

    model_config = ConfigDict(extra="forbid")

    vocab_size: int = Field(default=256, ge=2)
    d_model: int = Field(default=128, ge=8)
    n_layers: int = Field(default=2, ge=1)
    n_heads: int = Field(default=4, ge=1)
    seq_len: int = Field(default=64, ge=2)
    dropout: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Dropout makes the run depend on the RNG state, which a resume must restore."""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    causal_mask: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )
        self.drop = nn.Dropout(cfg.dropout)
        mask = torch.full((cfg.seq_len, cfg.seq_len), float("-inf")).triu(1)
        self.register_buffer("causal_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads) + self.causal_mask[:t, :t]
        att = self.drop(att.softmax(dim=-1))
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.norm2(x)))


class TinyLM(nn.Module):
    """Token and position embeddings, `n_layers` blocks, a final norm and a tied output head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(
                f"d_model ({cfg.d_model}) must be divisible by n_heads ({cfg.n_heads})"
            )
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        for emb in (self.tok, self.pos):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.tok.weight.T


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy of `model` (a TinyLM, or DDP around one) on a batch."""
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


class MarkovTokens:
    """An endless, deterministic stream of token sequences from a fixed random Markov chain.

    Each token has `branching` possible successors (a fixed random table), so a model can learn
    the chain and the loss falls towards log(branching). The chain depends only on `seed`; the
    sampling position on `seed`, `rank` and how many batches were drawn, which `state_dict`
    records.
    """

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        branching: int = 4,
    ) -> None:
        chain = torch.Generator().manual_seed(seed)
        self.successors = torch.randint(0, vocab_size, (vocab_size, branching), generator=chain)
        self.vocab_size, self.seq_len, self.batch_size = vocab_size, seq_len, batch_size
        self.generator = torch.Generator().manual_seed(seed * 1_000_003 + rank + 1)
        self.batches_drawn = 0

    def next_batch(self) -> torch.Tensor:
        """A `[batch_size, seq_len]` tensor of token ids."""
        g, n = self.generator, self.batch_size
        first = torch.randint(0, self.vocab_size, (n,), generator=g)
        choices = torch.randint(0, self.successors.shape[1], (n, self.seq_len), generator=g)
        tokens = torch.empty(n, self.seq_len, dtype=torch.long)
        tokens[:, 0] = first
        for t in range(1, self.seq_len):
            tokens[:, t] = self.successors[tokens[:, t - 1], choices[:, t]]
        self.batches_drawn += 1
        return tokens

    def state_dict(self) -> dict[str, Any]:
        """Plain types and tensors only, so it loads back with `weights_only=True`."""
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])


def warmup_then_inverse_sqrt(warmup_steps: int):
    """LR multiplier: linear warm-up to 1 over `warmup_steps`, then 1/sqrt decay. It does not
    depend on the run's length, so extending a run with a larger --steps keeps the schedule."""

    def factor(step: int) -> float:
        s = step + 1
        return s / warmup_steps if s < warmup_steps else math.sqrt(warmup_steps / s)

    return factor
