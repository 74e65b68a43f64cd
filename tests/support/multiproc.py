"""Run a function on N real ranks (spawned processes, gloo on 127.0.0.1) and collect results."""

from __future__ import annotations

import functools
import gc
import os
import pickle
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

from support.ports import free_port


def rank_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The torchrun-style environment of one rank of a job on 127.0.0.1:`port`."""
    return dict(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, out: str, args: tuple
) -> None:
    os.environ.update(rank_env(rank, world_size, port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
        # Free what `fn` left in reference cycles (a DDP module holds the default group) so
        # every group is destroyed here, not at interpreter exit: a gloo worker thread still
        # releasing a finished collective then aborts the process.
        gc.collect()
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180) -> list:
    """Call `fn(rank, world_size, *args)` on `world_size` spawned ranks; return their results
    in rank order. An exception on any rank fails the call; so does exceeding `timeout`."""
    with tempfile.TemporaryDirectory() as out:
        ctx = mp.start_processes(
            _entry,
            args=(fn, world_size, free_port(), out, args),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"ranks did not finish within {timeout}s")
        return [pickle.loads(Path(out, f"{r}.pkl").read_bytes()) for r in range(world_size)]


@functools.cache
def can_unshare_mounts() -> bool:
    """Whether this machine lets a process take its own mount namespace (`unshare`, as root),
    which the tests use to give a rank another "node's" disk at the same path."""
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        return False
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True
    )
    return probe.returncode == 0


def need_mount_namespaces() -> None:
    """Skip the calling test when this machine has no mount namespaces (`can_unshare_mounts`),
    except on CI (`CI` set to true), where they are available (root): there the test fails,
    so a multi-node test can never pass CI by being skipped."""
    if can_unshare_mounts():
        return
    why = "needs mount namespaces (unshare, as root) to give ranks their own node's disk"
    if os.environ.get("CI", "").lower() in ("true", "1", "yes"):
        pytest.fail(f"{why}; CI (CI={os.environ['CI']}) must run it, not skip it")
    pytest.skip(why)


def on_disk(disk: Path, at: Path) -> list[str]:
    """A `launch_ranks` prefix: the rank runs in its own mount namespace with `disk`
    bind-mounted at `at` (its node's local disk, seen at the path every node uses)."""
    script = f'mount --bind {disk} {at} && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


WORKER = Path(__file__).with_name("rank_worker.py")


def launch_ranks(
    scenario: str,
    world_size: int,
    out: Path,
    *args: str,
    prefix: Callable[[int], list[str]] | None = None,
    env: Callable[[int], dict[str, str]] | None = None,
    timeout: float = 240,
    worker: Path = WORKER,
) -> list[tuple[int, dict | None]]:
    """Run `tests/rank_worker.py SCENARIO` (or another `worker` script that runs
    `rank_worker.main`) as `world_size` separate processes (one per rank,
    optionally wrapped by `prefix(rank)`, e.g. in its own mount namespace) and return each
    rank's (exit code, JSON result or None). Ranks that outlive `timeout` are killed and fail
    the call: a hang is a test failure, never a pass."""
    import json
    import subprocess
    import sys

    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world_size):
        environ = dict(
            os.environ,
            **rank_env(rank, world_size, port),
            PYTHONPATH=os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")]),
        )
        environ.update(env(rank) if env else {})
        cmd = [
            *(prefix(rank) if prefix else []),
            sys.executable,
            str(worker),
            scenario,
            str(out),
            *args,
        ]
        log = open(out / f"rank{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, env=environ, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            logs = "\n".join((out / f"rank{r}.log").read_text()[-2000:] for r in range(world_size))
            raise TimeoutError(f"ranks of '{scenario}' hung for {timeout}s:\n{logs}") from None
    results = []
    for rank, code in enumerate(codes):
        f = out / f"rank{rank}.json"
        results.append((code, json.loads(f.read_text()) if f.exists() else None))
    return results
