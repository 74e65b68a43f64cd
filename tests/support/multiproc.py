"""Run a function on N real ranks (spawned processes, gloo on 127.0.0.1) and collect results."""

from __future__ import annotations

import ctypes
import functools
import gc
import importlib
import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch.distributed as dist
import torch.multiprocessing as torch_mp

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


_PORT_TAKEN = "EADDRINUSE"
"""In the error of a rank 0 whose rendezvous port was taken between `free_port` and its bind
(by a server or job of another test worker): no rank got past the rendezvous."""


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180) -> list:
    """Call `fn(rank, world_size, *args)` on `world_size` spawned ranks; return their results
    in rank order. An exception on any rank fails the call; so does exceeding `timeout`. A
    rendezvous port taken meanwhile is tried again with another (at most 3 times): `fn` never
    ran then."""
    for _ in range(2):
        try:
            return _run_ranks(fn, world_size, args, timeout)
        except torch_mp.ProcessRaisedException as e:
            if _PORT_TAKEN not in str(e):
                raise
    return _run_ranks(fn, world_size, args, timeout)


def _run_ranks(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float) -> list:
    with tempfile.TemporaryDirectory() as out:
        ctx = torch_mp.start_processes(
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
    the call: a hang is a test failure, never a pass. Each rank is a fresh interpreter, so a
    scenario about the interpreter's own exit (atexit hooks, finalization) runs for real;
    `fork_ranks` starts ranks in milliseconds where that is not the point."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = []
    for rank in range(world_size):
        environ = _rank_environ(rank, world_size, port, env)
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
    return _collect(
        scenario,
        out,
        [_Rank(p.wait, p.kill, subprocess.TimeoutExpired) for p in procs],
        timeout,
    )


def fork_ranks(
    worker: str,
    scenario: str,
    world_size: int,
    out: Path,
    *args: str,
    disk: Callable[[int], tuple[Path, Path]] | None = None,
    env: Callable[[int], dict[str, str]] | None = None,
    timeout: float = 240,
) -> list[tuple[int, dict | None]]:
    """`launch_ranks` for a `worker` module (e.g. "support.local_tier_worker", whose `main()`
    runs `rank_worker.main`) with each rank forked from a forkserver that preloaded it, torch
    and trainckpt (`forkserver_context`): a rank starts in milliseconds, not the seconds of a
    fresh interpreter's imports. Each rank is still its own process with its own environment,
    log (`OUT/rank{R}.log`, stdout and stderr), exit code (negative: the signal that killed
    it) and result; `disk(rank)` = (disk, at) gives it its own mount namespace with `disk`
    bind-mounted at `at` (what `on_disk` does for a script). Ranks that outlive `timeout` are
    killed and fail the call. The rank ends with `os._exit`: no atexit hook or interpreter
    finalization runs, so scenarios about those use `launch_ranks`."""
    out.mkdir(parents=True, exist_ok=True)
    ctx = forkserver_context()
    port = free_port()
    procs = []
    for rank in range(world_size):
        argv = [worker, scenario, str(out), *args]
        proc = ctx.Process(
            target=_forked_rank,
            args=(
                worker,
                argv,
                _rank_environ(rank, world_size, port, env),
                os.getcwd(),
                str(out / f"rank{rank}.log"),
                disk(rank) if disk else None,
            ),
        )
        proc.start()
        procs.append(proc)

    def waiter(p: Any) -> Callable[[float], int]:
        def wait(t: float) -> int:
            p.join(t)
            if p.exitcode is None:
                raise TimeoutError
            return p.exitcode

        return wait

    return _collect(scenario, out, [_Rank(waiter(p), p.kill, TimeoutError) for p in procs], timeout)


class _Rank(NamedTuple):
    wait: Callable[[float], int]  # the exit code, or raises `timed_out` after that many seconds
    kill: Callable[[], None]
    timed_out: type[BaseException]


def _rank_environ(
    rank: int, world_size: int, port: int, env: Callable[[int], dict[str, str]] | None
) -> dict[str, str]:
    """The whole environment of one rank: the test's, the rank's, `tests/` on PYTHONPATH."""
    environ = dict(
        os.environ,
        **rank_env(rank, world_size, port),
        PYTHONPATH=os.pathsep.join([str(WORKER.parents[1]), os.environ.get("PYTHONPATH", "")]),
    )
    environ.update(env(rank) if env else {})
    return environ


def _collect(
    scenario: str, out: Path, ranks: list[_Rank], timeout: float
) -> list[tuple[int, dict | None]]:
    """Wait for every rank (killing all of them once one outlives `timeout`: a TimeoutError
    with the end of each log); return each rank's (exit code, JSON result or None)."""
    deadline = time.monotonic() + timeout
    codes = []
    for r in ranks:
        try:
            codes.append(r.wait(max(1.0, deadline - time.monotonic())))
        except r.timed_out:
            for q in ranks:
                q.kill()
            logs = "\n".join((out / f"rank{n}.log").read_text()[-2000:] for n in range(len(ranks)))
            raise TimeoutError(f"ranks of '{scenario}' hung for {timeout}s:\n{logs}") from None
    results = []
    for rank, code in enumerate(codes):
        f = out / f"rank{rank}.json"
        results.append((code, json.loads(f.read_text()) if f.exists() else None))
    return results


FORKSERVER_PRELOAD = ["support.multiproc", "support.crash_worker", "support.local_tier_worker"]
"""What the tests' one forkserver imports before it forks anything: every module whose
functions run in forked processes (the crash tests' runs, `fork_ranks`' workers)."""


def forkserver_context() -> ForkServerContext:
    """The multiprocessing context of the tests' forkserver, started now if it is not running,
    with `FORKSERVER_PRELOAD` imported (Python 3.11's forkserver ignores the parent's sys.path;
    it does inherit PYTHONPATH, so `tests/` goes there while it starts)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(WORKER.parents[1]), old) if p)
    try:
        forkserver.ensure_running()
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    return ctx


def _forked_rank(
    worker: str,
    argv: list[str],
    environ: dict[str, str],
    cwd: str,
    log: str,
    disk: tuple[Path, Path] | None,
) -> None:
    """A forked rank (`fork_ranks`): take the rank's environment, working directory, log and
    node disk, then run `worker.main()` as `python worker SCENARIO OUT ARGS...` would."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if disk is not None:
        enter_mount_namespace(*disk)  # before anything starts a thread: unshare refuses those
    os.environ.clear()
    os.environ.update(environ)
    os.chdir(cwd)
    sys.argv = argv
    importlib.import_module(worker).main()


_CLONE_NEWNS = 0x00020000
_MS_BIND, _MS_REC, _MS_PRIVATE = 4096, 16384, 1 << 18


def enter_mount_namespace(disk: Path, at: Path) -> None:
    """Move this (single-threaded) process into its own mount namespace, private from `/` down
    (`unshare --mount --propagation private`), with `disk` bind-mounted at `at`
    (`mount --bind`): as `on_disk` does for a script. Python 3.11 has no `os.unshare`."""
    libc = ctypes.CDLL(None, use_errno=True)
    for what, code in (
        ("unshare(CLONE_NEWNS)", lambda: libc.unshare(_CLONE_NEWNS)),
        ("make / private", lambda: libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None)),
        (
            f"bind-mount {disk} at {at}",
            lambda: libc.mount(bytes(disk), bytes(at), None, _MS_BIND, None),
        ),
    ):
        if code() != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")
