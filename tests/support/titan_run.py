"""A CPU training run from torchtitan 0.3's own components, driven in its Trainer's call order.

torchtitan's Trainer needs CUDA, so this rebuilds its loop: the llama3 debug model (shrunk, and
with torchtitan's own SDPA inner attention instead of the flex attention that needs a compiled
kernel), its `OptimizersContainer` (AdamW, for-loop), `LRSchedulersContainer` (warm-up + linear
decay), `ParallelAwareDataloader` over a small synthetic token stream, and a `train_state`
object like the Trainer's. `manager(kind, ...)` builds torchtitan's own checkpoint manager or
trainckpt's with the same arguments, so every scenario runs against both.

Run as a script (`python tests/titan_run.py KIND FOLDER TOTAL STOP [key=value ...]`) it trains
to STOP and writes its final state to FOLDER/state-<pid>.pt, for kill-and-resume tests.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.checkpointer import CheckpointManager as TitanManager
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import (
    _EMBEDDING_INIT,
    _NORM_INIT,
    Llama3Model,
    Llama3StateDictAdapter,
    _build_llama3_layers,
    _output_linear_init,
)

from trainckpt.integrations.torchtitan import CheckpointManager as OurManager

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 128, 32, 4, 2, 16, 2


def model_config() -> Llama3Model.Config:
    """torchtitan's llama3 debug model (`_debugmodel`), shrunk, with a CPU attention."""
    layers = _build_llama3_layers(
        fuse_qkv=True,
        n_layers=LAYERS,
        dim=DIM,
        n_heads=HEADS,
        hidden_dim=64,
        rope=ComplexRoPE.Config(dim=DIM // HEADS, max_seq_len=256, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(
            num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT
        ),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(
            in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)
        ),
        layers=layers,
    )


class TokenStream(IterableDataset, Stateful):
    """A deterministic synthetic token stream: sample i is a pure function of i."""

    def __init__(self, dp_rank: int = 0) -> None:
        self.pos = 0
        self.dp_rank = dp_rank

    def __iter__(self):
        while True:
            gen = torch.Generator().manual_seed(self.pos + 1_000_000 * self.dp_rank)
            self.pos += 1
            tokens = torch.randint(0, VOCAB, (SEQ + 1,), generator=gen)
            yield {"input": tokens[:-1]}, tokens[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"pos": self.pos}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.pos = state_dict["pos"]


class TrainState(Stateful):
    """What torchtitan's Trainer saves as `train_state`."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"]
        self.ntokens_seen = state_dict["ntokens_seen"]


@dataclass
class Run:
    model: Llama3Model
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    dataloader: ParallelAwareDataloader
    train_state: TrainState
    adapter: Llama3StateDictAdapter
    total: int
    losses: list[float] = field(default_factory=list)


def build(
    total: int = 8,
    seed: int = 0,
    hf_assets_path: str | None = None,
    dp_rank: int = 0,
    dp_world_size: int = 1,
) -> Run:
    """Fresh components, as torchtitan's Trainer builds them (same seed: same weights); the
    data loader reads data-parallel rank `dp_rank`'s own samples."""
    torch.manual_seed(seed)
    config = model_config()
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=None)
    optimizers = OptimizersContainer.Config(
        param_groups=[
            ParamGroupConfig(
                pattern=r".*",
                optimizer_name="AdamW",
                optimizer_kwargs={"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1},
            )
        ],
        implementation="for-loop",
    ).build(model_parts=[model])
    lr_schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(
        optimizers=optimizers, training_steps=total
    )
    dataloader = ParallelAwareDataloader(
        TokenStream(dp_rank), dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=BATCH
    )
    return Run(
        model,
        optimizers,
        lr_schedulers,
        dataloader,
        TrainState(),
        Llama3StateDictAdapter(config, hf_assets_path),
        total,
    )


def manager(kind: str, run: Run, folder: Path | str, **config: Any):
    """torchtitan's own manager (`kind="torchtitan"`) or trainckpt's, built as the Trainer
    builds its checkpointer."""
    cls = TitanManager if kind == "torchtitan" else OurManager
    cfg = cls.Config(enable=True, folder=str(folder), **config)
    return cfg.build(
        dataloader=run.dataloader,
        model_parts=[run.model],
        optimizers=run.optimizers,
        lr_schedulers=run.lr_schedulers,
        states={"train_state": run.train_state},
        sd_adapter=run.adapter,
        base_folder="",
    )


def train(
    run: Run,
    ckpt: Any,
    *,
    stop: int | None = None,
    load_step: int = -1,
    before_save: Callable[[int], None] | None = None,
) -> Run:
    """torchtitan's `Trainer.train` loop on CPU: load, then per step zero_grad, forward,
    backward, `maybe_wait_for_staging`, optimizer and LR steps, `save(step, last_step)`; stops
    after step `stop` (default: the last) without closing the manager. `before_save(step)` runs
    before each save."""
    ckpt.load(step=load_step)
    data = iter(run.dataloader)
    stop = run.total if stop is None else stop
    while run.train_state.step < stop:
        run.train_state.step += 1
        run.optimizers.zero_grad()
        inputs, labels = next(data)
        logits = run.model(inputs["input"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        _average_gradients(run.model)
        run.train_state.ntokens_seen += labels.numel()
        ckpt.maybe_wait_for_staging()
        run.optimizers.step()
        run.lr_schedulers.step()
        run.losses.append(loss.item())
        if before_save is not None:
            before_save(run.train_state.step)
        ckpt.save(run.train_state.step, last_step=run.train_state.step == run.total)
    return run


def _average_gradients(model: torch.nn.Module) -> None:
    """Data parallelism as DDP does it: every rank steps with the mean gradient, so the
    replicated weights stay identical on every rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def snapshot(run: Run) -> dict[str, Any]:
    """Everything a resumed run must reproduce: weights, optimizer state, LR-scheduler step,
    data position and trainer state."""
    return {
        "model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
        "optim": {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in run.optimizers.state_dict().items()
        },
        "lr": run.lr_schedulers.state_dict(),
        "lrs": [g["lr"] for o in run.optimizers for g in o.param_groups],
        "data": run.dataloader.dataset.pos,  # type: ignore[attr-defined]
        "train": run.train_state.state_dict(),
    }


def assert_identical(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Bit-identical states (see `snapshot`)."""
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), f"model {k} differs"
    assert a["optim"].keys() == b["optim"].keys()
    for k, v in a["optim"].items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b["optim"][k]), f"optimizer {k} differs"
        else:
            assert v == b["optim"][k], f"optimizer {k} differs"
    for key in ("lr", "lrs", "data", "train"):
        assert a[key] == b[key], f"{key}: {a[key]} != {b[key]}"


def init_single_rank(folder: Path) -> None:
    """A gloo process group of one rank (torchtitan's manager needs one for async saves and
    retention), initialized through a file in `folder`."""
    import torch.distributed as dist

    folder.mkdir(parents=True, exist_ok=True)
    dist.init_process_group(
        "gloo", init_method=f"file://{folder / 'pg-init'}", rank=0, world_size=1
    )


def main(argv: list[str]) -> None:
    """KIND FOLDER TOTAL STOP [key=value ...]: train to STOP, close, save the final snapshot to
    FOLDER/../final.pt. `fault=POINT@STEP` arms trainckpt's fault point POINT (SIGKILL) just
    before the save of STEP; `kill_after_close=1` SIGKILLs the process as soon as `close()`
    returns (a job ended by its scheduler)."""
    kind, folder, total, stop, *extra = argv
    config: dict[str, Any] = {}
    fault, kill_after_close = None, False
    for item in extra:
        key, value = item.split("=", 1)
        if key == "fault":
            point, at = value.split("@")
            fault = (point, int(at))
        elif key == "kill_after_close":
            kill_after_close = True
        else:
            config[key] = int(value) if value.isdigit() else value
    init_single_rank(Path(folder).parent / f"pg-{os.getpid()}")
    run = build(int(total))
    ckpt = manager(kind, run, folder, **config)

    def arm(step: int) -> None:
        if fault is not None and step == fault[1]:
            from trainckpt.testing.faults import ENV_VAR

            ckpt.maybe_wait_for_saving()  # the fault is for this save, not the one before
            os.environ[ENV_VAR] = fault[0]

    train(run, ckpt, stop=int(stop), before_save=arm)
    ckpt.close()
    if kill_after_close:
        os.kill(os.getpid(), signal.SIGKILL)
    torch.save(snapshot(run), Path(folder).parent / "final.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
