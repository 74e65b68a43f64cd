"""Run a function on N real ranks (spawned processes, gloo on 127.0.0.1) and collect results."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, out: str, args: tuple
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        Path(out, f"{rank}.pkl").write_bytes(pickle.dumps(result))
    finally:
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
