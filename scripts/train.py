"""Train a tiny language model with trainckpt checkpoints: the example run.

    python scripts/train.py configs/train-tiny.yaml [--save-folder DIR_OR_URL] [--steps N]
    torchrun --nproc-per-node 2 scripts/train.py configs/train-tiny.yaml   # DDP on gloo

Resumes from the newest good checkpoint in the save folder (model, optimizer, LR scheduler,
data position and RNG state), so an interrupted-and-resumed run ends with exactly the parameters
of an uninterrupted one. On SIGTERM it finishes the current step, saves a checkpoint
synchronously and exits with status 143. Checkpoint policy and checkpointer settings come from
the `policy:` and `checkpointer:` sections of the config.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from pydantic import BaseModel, ConfigDict, Field
from tinylm import MarkovTokens, ModelConfig, TinyLM, lm_loss, warmup_then_inverse_sqrt
from torch.nn.parallel import DistributedDataParallel as DDP

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointManager,
    CheckpointPolicy,
    ModelAndOptim,
)

log = logging.getLogger("train")
SIGTERM_EXIT = 128 + signal.SIGTERM


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 1234
    batch_size: int = Field(default=16, ge=1)
    """Sequences per rank per step."""


class OptimConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lr: float = Field(default=3e-3, gt=0)
    weight_decay: float = Field(default=0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = Field(default=20, ge=1)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    steps: int = Field(default=200, ge=1)
    seed: int = 0
    log_every: int = Field(default=10, ge=1)
    threads: int = Field(default=1, ge=1)
    """Torch CPU threads per rank (more than the free cores makes CPU training crawl)."""


class ExampleConfig(BaseModel):
    """The whole example config file."""

    model_config = ConfigDict(extra="forbid")
    save_folder: str = "runs/tiny"
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    checkpointer: dict[str, Any] = {}
    policy: dict[str, Any] = {}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config", type=Path, help="YAML config, e.g. configs/train-tiny.yaml")
    p.add_argument("--save-folder", help="local folder or URL (gs://bucket/prefix) for checkpoints")
    p.add_argument("--steps", type=int, help="train until this step (overrides train.steps)")
    p.add_argument("--work-dir", help="node-local scratch folder (overrides checkpointer.work_dir)")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> ExampleConfig:
    raw = yaml.safe_load(args.config.read_text()) or {}
    cfg = ExampleConfig.model_validate(raw)
    if args.save_folder:
        cfg.save_folder = args.save_folder
    if args.steps is not None:
        cfg.train.steps = args.steps
    if args.work_dir:
        cfg.checkpointer["work_dir"] = args.work_dir
    return cfg


def setup_distributed() -> tuple[int, int]:
    """Join the torchrun job (gloo) when there is one; return (rank, world size)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    return (dist.get_rank(), world) if world > 1 else (0, 1)


def setup_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        stream=sys.stdout,
        format=f"%(asctime)s [rank{rank}] %(name)s: %(message)s",
    )


class StopFlag:
    """Set by SIGTERM; `agreed()` makes every rank stop after the same step."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def agreed(self, world: int) -> bool:
        if world == 1:
            return self.requested
        flag = torch.tensor([int(self.requested)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = setup_distributed()
    setup_logging(rank)
    cfg = load_config(args)
    stop = StopFlag()
    torch.set_num_threads(cfg.train.threads)
    torch.use_deterministic_algorithms(True)

    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank
    model = TinyLM(cfg.model)
    ddp_or_model: torch.nn.Module = DDP(model) if world > 1 else model
    optim = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=cfg.optim.betas,
        weight_decay=cfg.optim.weight_decay,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        optim, warmup_then_inverse_sqrt(cfg.optim.warmup_steps)
    )
    data = MarkovTokens(
        cfg.model.vocab_size, cfg.model.seq_len + 1, cfg.data.batch_size, cfg.data.seed, rank
    )
    torch.manual_seed(cfg.train.seed + 1 + rank)  # per-rank dropout
    module = ModelAndOptim(ddp_or_model, optim)

    checkpointer = CheckpointerConfig.validated(
        cfg.checkpointer, where=f"{args.config}: checkpointer"
    ).build()
    policy = CheckpointPolicy.validated(cfg.policy, where=f"{args.config}: policy")
    driver = CheckpointManager(checkpointer, policy, cfg.save_folder)
    step = resume(driver, module, sched, data)

    def trainer_state() -> dict[str, Any]:
        """Plain types and tensors only: it is loaded back with weights_only=True."""
        return {
            "step": step,
            "rng": torch.get_rng_state(),
            "data": data.state_dict(),
            "scheduler": sched.state_dict(),
            "world_size": world,
        }

    try:
        if step == 0:
            driver.maybe_save(0, module, trainer_state)  # pre-train checkpoint, if the policy wants
        if step >= cfg.train.steps:
            log.info("already at step %d (steps: %d): nothing to train", step, cfg.train.steps)
        else:
            log.info(
                "training steps %d..%d on %d rank(s), saving to '%s'",
                step + 1,
                cfg.train.steps,
                world,
                cfg.save_folder,
            )
        start = time.perf_counter()
        while step < cfg.train.steps and not stop.agreed(world):
            step += 1
            loss = lm_loss(ddp_or_model, data.next_batch())
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
            sched.step()
            if step % cfg.train.log_every == 0 or step == cfg.train.steps:
                log.info(
                    "step %d loss %.4f lr %.2e (%.2f steps/s)",
                    step,
                    loss.item(),
                    sched.get_last_lr()[0],
                    step / max(time.perf_counter() - start, 1e-9) if step else 0.0,
                )
            if step < cfg.train.steps:  # the last step gets the permanent final save below
                driver.maybe_save(step, module, trainer_state)
        if step < cfg.train.steps:
            path = driver.save(step, module, trainer_state, ephemeral=True)
            log.warning("SIGTERM: saved checkpoint '%s' at step %d; exiting", path, step)
            return SIGTERM_EXIT
        driver.save_final(step, module, trainer_state)  # permanent; policy.final_save says what
    finally:
        try:
            driver.finish()
        finally:
            checkpointer.close()
            if rank == 0:
                report(cfg.save_folder)
    return 0


def resume(
    driver: CheckpointManager,
    module: ModelAndOptim,
    sched: torch.optim.lr_scheduler.LRScheduler,
    data: MarkovTokens,
) -> int:
    """Load the newest step of either tier (the save folder's newest good checkpoint, or the
    node-local tier's newest step when newer), if any; return the step to continue from."""
    # A step-0 checkpoint loads weights only: the optimizer stays fresh, as it was at step 0.
    found = driver.resume(module)
    if found is None:
        log.info("no checkpoint in '%s': starting from scratch", driver.save_folder)
        return 0
    path, state = driver.resumed_from, found[1]
    if state is None:
        raise RuntimeError(f"'{path}' holds no trainer state; cannot resume from it")
    sched.load_state_dict(state["scheduler"])
    data.load_state_dict(state["data"])
    if state.get("world_size") == (dist.get_world_size() if dist.is_initialized() else 1):
        torch.set_rng_state(state["rng"])
    else:
        log.warning("world size changed since '%s': keeping this rank's fresh RNG state", path)
    log.info("resuming from '%s' (step %d)", path, state["step"])
    return int(state["step"])


def report(folder: str) -> None:
    """Print where the checkpoints went."""
    found = list(Checkpointer.find_checkpoints(folder))
    print(f"checkpoints in {folder}:", flush=True)
    for step, path in found:
        kind = "ephemeral" if Checkpointer.read_metadata(path).ephemeral else "permanent"
        print(f"  step {step:>6}  {kind:<9}  {path}", flush=True)
    if not found:
        print("  (none)", flush=True)
    print("run again with the same --save-folder (and a larger --steps) to resume", flush=True)


if __name__ == "__main__":
    sys.exit(main())
