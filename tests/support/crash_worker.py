"""A small deterministic training run that crash tests start, kill with SIGKILL and restart.

Runs are forked from a forkserver that has imported torch and trainckpt once (`start_run`), so a
repetition costs milliseconds of start-up, not seconds. Every value a run saves at step N is a
pure function of N (`reference`), so after any kill the tests can say exactly what each
checkpoint must hold.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainckpt import Checkpointer, CheckpointerConfig, CheckpointError, ModelAndOptim
from trainckpt.testing.faults import ENV_VAR

WIDTH = 384  # two Linear layers: ~0.3M parameters, ~3.5 MB per checkpoint with AdamW moments
KEEP = 2  # committed checkpoints the run keeps; older ones are deleted after each save
COLLECTIVE_TIMEOUT = 30.0  # seconds a rank waits for a dead peer in multi-rank runs
CLAIM_LEASE = 2.0
"""Object stores: lease of a run's claim on the step it saves, so a restarted run takes the
step of a killed save over after 2 s instead of the default 30 s."""


FROZEN_ENV = "TRAINCKPT_TEST_FROZEN_FIRST_LAYER"
"""Set (in the run's `env` and the test's environment): the first layer is frozen (not in the
optimizer), so from the second save of a run on, incremental saves link its files."""


def new_module() -> ModelAndOptim:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.Linear(2 * WIDTH, WIDTH)
    )
    trained = model[1].parameters() if os.environ.get(FROZEN_ENV) else model.parameters()
    return ModelAndOptim(model, torch.optim.AdamW(trained, lr=1e-3))


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


_reference: list[Any] = [0, None, None]  # (step, module, frozen) of the last answer


def reference(step: int) -> ModelAndOptim:
    """The model and optimizer an uninterrupted run holds after `step` steps (read-only: the
    answer is cached and advanced by the next call with a later step)."""
    done, module, frozen = _reference
    if module is None or done > step or frozen != os.environ.get(FROZEN_ENV):
        done, module = 0, new_module()
    for s in range(done + 1, step + 1):
        train_step(module, s)
    _reference[:] = [step, module, os.environ.get(FROZEN_ENV)]
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
    env: dict[str, str] | None = None,
    retry_deadline: float = 300.0,
    keep: int | None = KEEP,
) -> None:
    """Resume from the newest good checkpoint in `folder` (or start), train and save every step
    up to `last_step` (`mode`: "sync" or "async"), keeping `KEEP` checkpoints. With `fault`, the
    fault point of that name kills this process during the save of `fault_step`. `ready` is set
    once the run is about to train. `url` (optional) is where checkpoints go instead of
    `folder`, e.g. a gs:// prefix; `env` is applied first (a forked run inherits the
    forkserver's environment, not the test's). `keep=None` deletes nothing."""
    os.environ.update(env or {})
    torch.set_num_threads(1)  # tiny tensors; two cores shared by many processes
    if "WORLD_SIZE" in os.environ:  # one rank of a multi-rank run (gloo on 127.0.0.1)
        dist.init_process_group("gloo", timeout=timedelta(seconds=COLLECTIVE_TIMEOUT))
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    target = url or folder
    ckpt = CheckpointerConfig(
        work_dir=work_dir,
        fs_timeout=20,
        retry_deadline=retry_deadline,
        collective_timeout=COLLECTIVE_TIMEOUT,
        claim_lease=CLAIM_LEASE,
    ).build()
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
        if keep is not None and rank0:
            prune(target, keep)
    ckpt.close()
    if keep is not None and rank0:
        prune(target, keep)
    if dist.is_initialized():
        dist.destroy_process_group()


def rollback_run(
    folder: str,
    work_dir: str,
    resume_step: int,
    last_step: int,
    fault: str | None = None,
    fault_step: int | None = None,
    ready: Event | None = None,
    env: dict[str, str] | None = None,
) -> None:
    """Roll back: load `folder/step{resume_step}` (of a run that went further), tell a
    `CheckpointManager` so (`start_from`), then train and save every step up to `last_step`,
    each trainer state marked `"trajectory": "new"`. With `fault`, that fault point kills this
    process during the save of `fault_step`. `folder` may be a URL (`env` points the client
    at its server, as in `run`)."""
    from trainckpt import CheckpointManager, CheckpointPolicy

    os.environ.update(env or {})
    torch.set_num_threads(1)
    ckpt = CheckpointerConfig(work_dir=work_dir, fs_timeout=20, claim_lease=CLAIM_LEASE).build()
    policy = CheckpointPolicy(save_interval=1, remove="all_non_permanent")
    driver = CheckpointManager(ckpt, policy, folder)
    module = new_module()
    ckpt.load(f"{folder}/{Checkpointer.checkpoint_dirname(resume_step)}", module)
    driver.start_from(resume_step)
    if ready is not None:
        ready.set()
    for step in range(resume_step + 1, last_step + 1):
        train_step(module, step)
        if step == fault_step and fault is not None:
            os.environ[ENV_VAR] = fault
        driver.save(step, module, {**trainer_state(step), "trajectory": "new"})
    driver.finish()
    ckpt.close()


def run_recorded(*args: Any, outcome: str, **kwargs: Any) -> None:
    """`run(*args, **kwargs)`; the exception that ends it, if any, is written to the file
    `outcome` first (`recorded`), so the parent can tell why a run exited with code 1."""
    with recorded(outcome):
        run(*args, **kwargs)


@contextlib.contextmanager
def recorded(outcome: str) -> Iterator[None]:
    """Write the exception that ends the block to `outcome` as JSON (type, message and whether
    it is a `CheckpointError`, for it and each exception it was raised from), then let it
    propagate: a storage failure and a failed assertion both exit with code 1."""
    try:
        yield
    except BaseException as e:
        chain: list[dict[str, Any]] = []
        error: BaseException | None = e
        while error is not None and len(chain) < 8:
            chain.append(
                {
                    "type": type(error).__name__,
                    "checkpoint_error": isinstance(error, CheckpointError),
                    "message": str(error)[:4000],
                }
            )
            error = error.__cause__ or error.__context__
        Path(outcome).write_text(json.dumps(chain))
        raise


def read_outcome(outcome: Path) -> list[dict[str, Any]] | None:
    """The exception chain a `run_recorded` run wrote, outermost first; None if it ended
    without one."""
    return json.loads(outcome.read_text()) if outcome.exists() else None


def save_once(
    url: str,
    work_dir: str,
    steps: int,
    threads: int,
    env: dict[str, str],
    go: Event,
    results: Any,
    lease: float = CLAIM_LEASE,
    fault: str | None = None,
    ready: Event | None = None,
) -> None:
    """Train `steps` steps, then save once to the checkpoint folder `url` with
    `save_thread_count=threads` (the number of shard files), as soon as `go` is set. Puts
    (steps, outcome, message) on `results`: outcome "committed" or the error's class name.
    With `fault`, the fault point of that name kills this process during the save."""
    os.environ.update(env)
    torch.set_num_threads(1)
    module = new_module()
    for step in range(1, steps + 1):
        train_step(module, step)
    ckpt = CheckpointerConfig(
        work_dir=work_dir, save_thread_count=threads, retry_deadline=60, claim_lease=lease
    ).build()
    if fault is not None:
        os.environ[ENV_VAR] = fault
    if ready is not None:
        ready.set()
    go.wait(JOIN_TIMEOUT)
    try:
        results.put((steps, "committed", ckpt.save(url, module, trainer_state(steps))))
    except Exception as e:
        results.put((steps, type(e).__name__, str(e)))
    finally:
        ckpt.close()


def delete_loop(
    folder: str, kind: str, env: dict[str, str], stop: Event, results: Any, ready: Event | None
) -> None:
    """Another job's deletions beside a save, until `stop` is set: `trainckpt prune` rounds
    (`kind="prune"`, keeping 1000 permanent checkpoints: only leftovers go) or retention
    rounds (`kind="retention"`, `remove: all_non_permanent`). Puts the number of rounds run
    on `results`."""
    from trainckpt import CheckpointPolicy
    from trainckpt.errors import CheckpointNotFoundError
    from trainckpt.format.folder_scan import scan_folder
    from trainckpt.retention.prune import apply_prune, plan_prune
    from trainckpt.retention.remover import Remover
    from trainckpt.storage import resolve

    os.environ.update(env)
    remover = Remover(folder, CheckpointPolicy(remove="all_non_permanent"))
    rounds = 0
    if ready is not None:
        ready.set()
    while not stop.wait(0.02):  # a pause between rounds: two cores shared with the save
        if kind == "retention":
            remover.run_round()
        else:
            try:
                storage, path = resolve(folder)
                entries = scan_folder(storage, path)
                plan = plan_prune(path, entries, keep_last=1000, keep_ephemeral=False)
            except CheckpointNotFoundError:  # nothing committed yet: prune refuses
                continue
            apply_prune(plan, on_deleted=lambda entry: None)
        rounds += 1
    remover.close()
    results.put(rounds)


def save_steps(
    folder: str,
    work_dir: str,
    steps: list[int],
    out: str,
    shards: int = 2,
    ready: Event | None = None,
    start: Any = None,
    dirname: str | None = None,
) -> None:
    """Save, to `folder/step{N}` for each of `steps` (ascending), what an uninterrupted run
    holds after N steps: no resume, no deletion. `ready` is set once the first save returned;
    with `start` (a multiprocessing barrier), the first save begins when every racer passed it;
    with `dirname`, every save goes to `folder/dirname` (racers saving different states to one
    step). Each save's outcome goes to `out` as a JSON list; no failed save stops the run, so
    the test sees every one. `shards`: DCP files per save."""
    torch.set_num_threads(1)
    ckpt = CheckpointerConfig(work_dir=work_dir, fs_timeout=600, save_thread_count=shards).build()
    outcomes = []
    try:
        for i, step in enumerate(steps):
            module = reference(step)
            if i == 0 and start is not None:
                start.wait()
            began = time.monotonic()
            try:
                name = dirname or Checkpointer.checkpoint_dirname(step)
                path = ckpt.save(f"{folder}/{name}", module, trainer_state(step))
                outcomes.append({"step": step, "committed": path})
            except Exception as e:
                outcomes.append(
                    {
                        "step": step,
                        "error": type(e).__name__,
                        "message": str(e),
                        "checkpoint_error": isinstance(e, CheckpointError),
                        "seconds": time.monotonic() - began,
                    }
                )
            if ready is not None:
                ready.set()
    finally:
        ckpt.close()
        Path(out).write_text(json.dumps(outcomes))


def run_cli(argv: list[str], out: str) -> None:
    """`trainckpt ARGV` in this process; its exit code and output go to `out` as JSON."""
    from trainckpt.cli.main import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        code = main(argv)
    Path(out).write_text(json.dumps({"code": code, "output": buf.getvalue()}))


def _warm_up() -> None:
    """Pay lazy imports (an optimizer's first use imports torch._dynamo: seconds) once, in the
    forkserver, instead of in every forked run. No tensor op runs here: a forked child must
    not inherit an initialized OpenMP thread pool."""
    import torch._dynamo  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401


_warm_up()


# -- the parent's side --------------------------------------------------------------------------


@dataclass
class Launcher:
    """Starts runs as processes forked from one forkserver that preloaded this module."""

    ctx: ForkServerContext

    @classmethod
    def create(cls) -> Launcher:
        """Start the tests' forkserver now, with this module preloaded
        (`multiproc.forkserver_context`)."""
        from support.multiproc import forkserver_context

        return cls(forkserver_context())

    def call(self, fn: Any, *args: Any, **kwargs: Any) -> BaseProcess:
        """Start `fn(*args, **kwargs)`, a function of this module, in a forked process."""
        proc = self.ctx.Process(target=fn, args=args, kwargs=kwargs)
        proc.start()
        return proc

    def start(self, *args: Any, target: Any = run, **kwargs: Any) -> tuple[BaseProcess, Event]:
        """Start `target` (a function of this module: `run` or `save_once`) in a new process;
        returns it with the event it sets once ready."""
        ready = self.ctx.Event()
        proc = self.ctx.Process(target=target, args=args, kwargs={**kwargs, "ready": ready})
        proc.start()
        return proc, ready


def check_checkpoints(folder: str | Path, work_dir: str | Path | None = None) -> list[int]:
    """Every checkpoint the finders report in `folder` (a path or URL): passes a deep verify
    and loads exactly the values of `reference(step)` and `trainer_state(step)`. Returns the
    steps found. `work_dir` (the download cache for URLs) defaults to a folder next to
    `folder`."""
    work = work_dir if work_dir is not None else Path(folder).parent / "check"
    steps = []
    for step, path in Checkpointer.find_checkpoints(folder):
        check_checkpoint(path, step, work)
        steps.append(step)
    return steps


def check_checkpoint(path: str, step: int, work_dir: str | Path) -> None:
    """The checkpoint at `path` passes a deep verify and loads exactly the values a run holds
    after `step` steps (`reference(step)`, `trainer_state(step)`)."""
    from support.models import assert_same_state  # tests/ is on sys.path in the parent

    report = Checkpointer.verify(path, deep=True)
    assert report.ok, str(report)
    ckpt = CheckpointerConfig(work_dir=work_dir).build()
    try:
        dst = _scrambled()
        state = ckpt.load(path, dst)
        assert state is not None and state["step"] == step, (path, state)
        assert torch.equal(state["marker"], trainer_state(step)["marker"]), path
        assert_same_state(reference(step), dst)
    finally:
        ckpt.close()


def _scrambled() -> ModelAndOptim:
    """A module of the right shape holding values no checkpoint has."""
    module = new_module()
    train_step(module, 10_000)
    with torch.no_grad():  # a frozen layer too
        for p in module.model.parameters():
            p.add_(1.0)
    return module


JOIN_TIMEOUT = 120.0
"""How long a run of a few 3.5 MB saves may take, generous for a loaded 2-core machine."""


def finish(proc: BaseProcess) -> int:
    """Wait for a run to end (bounded) and return its exit code (-9: SIGKILLed)."""
    import pytest

    proc.join(JOIN_TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"the run did not end within {JOIN_TIMEOUT}s")
    assert proc.exitcode is not None
    return proc.exitcode


def start_on_gcs(
    launcher: Launcher, tmp_path: Path, url: str, emulator: str, last: int, mode: str, **kw: Any
) -> tuple[BaseProcess, Event]:
    """Start a run saving to the gs:// `url`, its client pointed at the server `emulator`."""
    env = {"STORAGE_EMULATOR_HOST": emulator, "NO_GCE_CHECK": "true"}
    work = str(tmp_path / "work")
    return launcher.start(str(tmp_path / "unused"), work, last, mode, url=url, env=env, **kw)


def start_on_s3(
    launcher: Launcher, tmp_path: Path, url: str, endpoint: str, last: int, mode: str, **kw: Any
) -> tuple[BaseProcess, Event]:
    """Start a run saving to the s3:// `url`, its client pointed at the server `endpoint`
    with the test session's dummy credentials (the `s3_server` fixture set them)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    env["AWS_ENDPOINT_URL_S3"] = endpoint
    work = str(tmp_path / "work")
    return launcher.start(str(tmp_path / "unused"), work, last, mode, url=url, env=env, **kw)


def tmp_folders(folder: Path) -> Iterator[Path]:
    return folder.glob("*-tmp")
