"""OLMo-core's real Trainer on CPU, tiny: the shared builder of the OLMo-core drop-in tests.

A 2-layer `olmo2_1M` transformer, `TransformerTrainModule` with AdamW, OLMo-core's numpy data
loader over a synthetic token file, and `CheckpointerCallback` with permanent (every 5 steps)
and ephemeral (every 2) saves. The checkpointer is OLMo-core's own or trainckpt's, chosen by
config (`TrainerConfig(checkpointer=...)`), nothing else changed.

Also a command line, for runs in their own process (crash and `torchrun` tests):
`python olmo_trainer.py ROOT SAVE_FOLDER CHECKPOINTER [--async] [--stop N] [--kill-at N]
[--ddp] [--direct] [--out FILE]` trains to step 10 (or stops at N) and writes a `snapshot` to FILE.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
from olmo_core.distributed.checkpoint import load_state_dict, save_state_dict
from olmo_core.distributed.parallel import DataParallelType
from olmo_core.distributed.utils import get_rank
from olmo_core.nn.transformer import TransformerConfig
from olmo_core.optim import AdamWConfig
from olmo_core.train import Duration, Trainer, TrainerConfig
from olmo_core.train.callbacks import Callback, CheckpointerCallback, ConfigSaverCallback
from olmo_core.train.checkpoint import CheckpointerConfig as OLMoConfig
from olmo_core.train.train_module import (
    TransformerDataParallelConfig,
    TransformerTrainModule,
    TransformerTrainModuleConfig,
)
from olmo_core.utils import seed_all

from trainckpt import OLMoCheckpointerConfig
from trainckpt.testing.faults import ENV_VAR as FAULT_ENV

VOCAB = 64
SEQ = 16
BATCH = 4  # sequences per step, over all ranks
STEPS = 10
SAVE_INTERVAL = 5
EPHEMERAL_INTERVAL = 2


def write_tokens(path: Path) -> Path:
    """A synthetic token file (uint16, as OLMo-core's numpy datasets read them)."""
    if not path.exists():
        tokens = np.random.default_rng(0).integers(0, VOCAB, SEQ * 64, dtype=np.uint16)
        tokens.tofile(path)
    return path


class DirectTrainModule(TransformerTrainModule):
    """A `TransformerTrainModule` with OLMo-core's "direct" checkpoint API: it writes and reads
    its DCP folder itself (with OLMo-core's own DCP functions), as OLMo-core's
    `OLMoDDPTrainModule` does (which needs CUDA and its fused MoE model, so cannot run here).
    `calls` records each call and its keywords."""

    calls: list[tuple[str, dict[str, Any]]]

    def save_state_dict_direct(self, dir: str, **kwargs: Any) -> None:
        self.calls.append(("save", kwargs))
        save_state_dict(
            dir,
            self.state_dict_to_save(),
            process_group=kwargs["process_group"],
            save_overwrite=kwargs["save_overwrite"],
            thread_count=kwargs["thread_count"],
        )

    def load_state_dict_direct(self, dir: str, **kwargs: Any) -> None:
        from olmo_core.distributed.checkpoint import get_checkpoint_metadata

        self.calls.append(("load", kwargs))
        state = self.state_dict_to_load(
            get_checkpoint_metadata(dir), optim=kwargs["load_optim_state"]
        )
        load_state_dict(
            dir,
            state,
            process_group=kwargs["process_group"],
            work_dir=kwargs["work_dir"],
            thread_count=kwargs["thread_count"],
        )
        self.load_state_dict(state)


class KillDuringSave(Callback):
    """Arms a trainckpt fault point just before the checkpointer callback saves at `step`: the
    process is SIGKILLed when that save reaches the point (in the background for async saves)."""

    priority = 2  # runs before CheckpointerCallback (priority 1)

    def __init__(self, step: int, point: str) -> None:
        self.kill_step, self.point = step, point

    def post_train_batch(self) -> None:
        if self.step == self.kill_step:
            # The previous step's async save may still be writing: let it commit first, so the
            # point fires in this step's save only (the checkpointer callback, which runs next,
            # waits for it the same way before it saves).
            self.trainer.callbacks["checkpointer"]._await_last_checkpoint()  # type: ignore[attr-defined]
            os.environ[FAULT_ENV] = self.point


@dataclass
class Run:
    """How to train: which checkpointer, async or not, where to stop."""

    checkpointer: str = "trainckpt"  # or "olmo"
    save_async: bool = False
    stop: int | None = None  # hard stop at this step (a checkpoint is saved there)
    direct: bool = False  # train module with the direct checkpoint API
    ddp: bool = False
    kill_at: int | None = None  # SIGKILL during the save at this step
    kill_point: str = "writing-shards"
    rollback_on_load: bool = False  # with trainckpt's RollbackOnLoadCallback


def build_trainer(root: Path, save_folder: Path, run: Run) -> Trainer:
    """The Trainer of one run; `root` holds the token file and the dataset's work folder."""
    seed_all(0)
    model = TransformerConfig.olmo2_1M(vocab_size=VOCAB, n_layers=2).build(init_device="cpu")
    module_config = TransformerTrainModuleConfig(
        rank_microbatch_size=BATCH // 2 * SEQ,  # fits 1 or 2 ranks
        max_sequence_length=SEQ,
        optim=AdamWConfig(lr=1e-2),
        dp_config=TransformerDataParallelConfig(name=DataParallelType.ddp) if run.ddp else None,
    )
    if run.direct:
        module: TransformerTrainModule = DirectTrainModule(
            model=model,
            device=torch.device("cpu"),
            **module_config.as_dict(exclude_none=True, recurse=False),
        )
        module.calls = []  # type: ignore[attr-defined]
    else:
        module = module_config.build(model, device=torch.device("cpu"))
    dataset = NumpyFSLDatasetConfig(
        paths=[str(write_tokens(root / "tokens.npy"))],
        sequence_length=SEQ,
        tokenizer=TokenizerConfig(vocab_size=VOCAB, eos_token_id=VOCAB - 1, pad_token_id=0),
        work_dir=str(root / "dataset-work"),
    ).build()
    loader = NumpyDataLoaderConfig(global_batch_size=BATCH * SEQ, seed=0).build(
        dataset, dp_process_group=module.dp_process_group
    )
    callbacks: dict[str, Callback] = {
        "checkpointer": CheckpointerCallback(
            save_interval=SAVE_INTERVAL,
            ephemeral_save_interval=EPHEMERAL_INTERVAL,
            save_async=run.save_async,
        ),
        # Writes config.json and data_paths.txt into each checkpoint once it is saved.
        "config_saver": ConfigSaverCallback(),
    }
    if run.kill_at is not None:
        callbacks["kill"] = KillDuringSave(run.kill_at, run.kill_point)
    if run.rollback_on_load:
        from trainckpt.integrations.olmo_rollback import RollbackOnLoadCallback

        callbacks["rollback"] = RollbackOnLoadCallback()
    checkpointer = OLMoConfig() if run.checkpointer == "olmo" else OLMoCheckpointerConfig()
    config = TrainerConfig(
        save_folder=str(save_folder),
        work_dir=str(root / f"work-{get_rank()}"),
        checkpointer=checkpointer,
        max_duration=Duration.steps(STEPS),
        hard_stop=Duration.steps(run.stop) if run.stop is not None else None,
        metrics_collect_interval=STEPS,
        callbacks=callbacks,
    )
    trainer = config.build(module, loader)
    saver = trainer.callbacks["config_saver"]
    assert isinstance(saver, ConfigSaverCallback)
    saver.config = config.as_config_dict()
    return trainer


def train(root: Path, save_folder: Path, run: Run) -> dict[str, Any]:
    """Build a trainer, fit it (resuming from `save_folder` if it holds a checkpoint) and
    return its `snapshot`."""
    trainer = build_trainer(root, save_folder, run)
    trainer.fit()
    return snapshot(trainer)


def snapshot(trainer: Trainer) -> dict[str, Any]:
    """What must match bit for bit: model and optimizer state, step, tokens seen, data loader
    state. Optimizer state is keyed by parameter name, so two trainers compare."""
    module = trainer.train_module
    assert isinstance(module, TransformerTrainModule)
    names = {id(p): n for n, p in module.model.named_parameters()}
    optim = module.optim
    return {
        "model": {k: v.detach().clone() for k, v in module.model.state_dict().items()},
        "optim": {
            names[id(p)]: {k: v.clone() for k, v in optim.state[p].items()}
            for group in optim.param_groups
            for p in group["params"]
        },
        "step": trainer.global_step,
        "tokens": trainer.global_train_tokens_seen,
        "data_loader": trainer.data_loader.state_dict(),
    }


def assert_identical(a: dict[str, Any], b: dict[str, Any], path: str = "") -> None:
    """Equal structure and bit-identical tensors."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{path}: keys differ"
        for k in a:
            assert_identical(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("root", type=Path)
    p.add_argument("save_folder", type=Path)
    p.add_argument("checkpointer", choices=["trainckpt", "olmo"])
    p.add_argument("--async", dest="save_async", action="store_true")
    p.add_argument("--stop", type=int)
    p.add_argument("--kill-at", type=int)
    p.add_argument("--ddp", action="store_true")
    p.add_argument("--direct", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    run = Run(
        args.checkpointer,
        args.save_async,
        args.stop,
        direct=args.direct,
        ddp=args.ddp,
        kill_at=args.kill_at,
    )
    if args.ddp:
        from olmo_core.train import prepare_training_environment, teardown_training_environment

        prepare_training_environment(seed=0, backend="gloo")
    result = train(args.root, args.save_folder, run)
    if args.out is not None:
        torch.save(result, args.out.with_suffix(f".rank{get_rank()}.pt"))
    if args.ddp:
        teardown_training_environment()


if __name__ == "__main__":
    main()
