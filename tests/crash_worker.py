"""A small deterministic training run that crash tests start, kill with SIGKILL and restart.

Runs are forked from a forkserver that has imported torch and trainckpt once (`start_run`), so a
repetition costs milliseconds of start-up, not seconds. Every value a run saves at step N is a
pure function of N (`reference`), so after any kill the tests can say exactly what each
checkpoint must hold.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import torch

from trainckpt import Checkpointer, CheckpointerConfig, ModelAndOptim
from trainckpt.faults import ENV_VAR

WIDTH = 384  # two Linear layers: ~0.3M parameters, ~3.5 MB per checkpoint with AdamW moments
KEEP = 2  # committed checkpoints the run keeps; older ones are deleted after each save

torch.set_num_threads(1)  # tiny tensors; and no OpenMP pool in the forkserver to fork from


def new_module() -> ModelAndOptim:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)
    )
    return ModelAndOptim(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def train_step(module: ModelAndOptim, step: int) -> None:
    """One optimizer step with gradients that depend only on `step`."""
    gen = torch.Generator().manual_seed(1000 + step)
    for p in module.model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    assert module.optim is not None
    module.optim.step()
    module.optim.zero_grad()


def trainer_state(step: int) -> dict[str, Any]:
    return {"step": step, "marker": torch.arange(8) * step, "note": f"step {step}"}


def reference(step: int) -> ModelAndOptim:
    """The model and optimizer an uninterrupted run holds after `step` steps."""
    module = new_module()
    for s in range(1, step + 1):
        train_step(module, s)
    return module


def prune(folder: str, keep: int) -> None:
    """Delete all but the newest `keep` committed checkpoints (commit record first)."""
    try:
        found = list(Checkpointer.find_checkpoints(folder))
    except FileNotFoundError:  # nothing committed yet (an async save still writing)
        return
    for _step, path in found[:-keep]:
        Checkpointer.delete(path)


def run(
    folder: str,
    work_dir: str,
    last_step: int,
    mode: str,
    fault: str | None = None,
    fault_step: int | None = None,
    ready: Event | None = None,
    url: str | None = None,
) -> None:
    """Resume from the newest good checkpoint in `folder` (or start), train and save every step
    up to `last_step` (`mode`: "sync" or "async"), keeping `KEEP` checkpoints. With `fault`, the
    fault point of that name kills this process during the save of `fault_step`. `ready` is set
    once the run is about to train. `url` (optional) is where checkpoints go instead of
    `folder`, e.g. a gs:// prefix."""
    target = url or folder
    ckpt = CheckpointerConfig(work_dir=work_dir, fs_timeout=20).build()
    module = new_module()
    start = 0
    good = ckpt.find_latest_good(target)
    if good is not None:
        state = ckpt.load(good, module)
        assert state is not None
        start = state["step"]
    if ready is not None:
        ready.set()
    for step in range(start + 1, last_step + 1):
        train_step(module, step)
        if step == fault_step and fault is not None:
            ckpt.wait()  # the previous async save must not see the fault point
            os.environ[ENV_VAR] = fault
        path = f"{target}/{Checkpointer.checkpoint_dirname(step)}"
        if mode == "sync":
            ckpt.save(path, module, trainer_state(step))
        else:
            ckpt.save_async(path, module, trainer_state(step))
        prune(target, KEEP)
    ckpt.close()
    prune(target, KEEP)


def _warm_up() -> None:
    """Pay lazy imports (an optimizer's first use imports torch._dynamo: seconds) once, in the
    forkserver, instead of in every forked run."""
    module = new_module()
    train_step(module, 1)
    module.state_dict_to_save()


_warm_up()


# -- the parent's side --------------------------------------------------------------------------


@dataclass
class Launcher:
    """Starts runs as processes forked from one forkserver that preloaded this module."""

    ctx: ForkServerContext

    @classmethod
    def create(cls) -> Launcher:
        """Start the forkserver now, able to import this module (Python 3.11's forkserver
        ignores the parent's sys.path; it does inherit PYTHONPATH)."""
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["crash_worker"])
        here = str(Path(__file__).resolve().parent)
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, old) if p)
        try:
            forkserver.ensure_running()
        finally:
            if old is None:
                del os.environ["PYTHONPATH"]
            else:
                os.environ["PYTHONPATH"] = old
        return cls(ctx)

    def start(self, *args: Any, **kwargs: Any) -> tuple[BaseProcess, Event]:
        ready = self.ctx.Event()
        proc = self.ctx.Process(target=run, args=args, kwargs={**kwargs, "ready": ready})
        proc.start()
        return proc, ready


def check_checkpoints(folder: str | Path, into: ModelAndOptim | None = None) -> list[int]:
    """Every checkpoint the finders report in `folder`: passes a deep verify and loads exactly
    the values of `reference(step)` and `trainer_state(step)`. Returns the steps found."""
    from models import assert_same_state  # tests/ is on sys.path in the parent

    ckpt = CheckpointerConfig(work_dir=Path(str(folder).split("://")[-1]).parent / "check").build()
    steps = []
    try:
        for step, path in Checkpointer.find_checkpoints(folder):
            report = Checkpointer.verify(path, deep=True)
            assert report.ok, str(report)
            dst = into or _scrambled()
            state = ckpt.load(path, dst)
            assert state is not None and state["step"] == step, (path, state)
            assert torch.equal(state["marker"], trainer_state(step)["marker"]), path
            assert_same_state(reference(step), dst)
            steps.append(step)
    finally:
        ckpt.close()
    return steps


def _scrambled() -> ModelAndOptim:
    """A module of the right shape holding values no checkpoint has."""
    module = new_module()
    train_step(module, 10_000)
    return module


def tmp_folders(folder: Path) -> Iterator[Path]:
    return folder.glob("*-tmp")
