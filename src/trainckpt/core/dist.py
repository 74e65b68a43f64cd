"""Rank, world size and the few collectives the commit protocol needs.

Every helper is a no-op (or the obvious single-process answer) when `torch.distributed` is not
initialized, so the same code path serves one CPU process and many nodes.
"""

from __future__ import annotations

import datetime as _dt
import logging
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch.distributed as dist

from trainckpt.errors import ConfigurationError, RankFailedError

log = logging.getLogger(__name__)
T = TypeVar("T")
ProcessGroup = dist.ProcessGroup


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group: ProcessGroup | None = None) -> int:
    return dist.get_rank(group) if is_distributed() else 0


def get_world_size(group: ProcessGroup | None = None) -> int:
    return dist.get_world_size(group) if is_distributed() else 1


@contextmanager
def peers(what: str) -> Generator[None, None, None]:
    """Turn a collective that failed because a peer died or timed out into `RankFailedError`."""
    try:
        yield
    except RuntimeError as e:  # gloo's connection and timeout errors (DistBackendError too)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RankFailedError(
            f"{what}: lost contact with another rank ({first[:300]}); it crashed, was killed "
            "or is stuck: check its log. This save or load did not complete"
        ) from e


def barrier(group: ProcessGroup | None = None) -> None:
    """Called on: all ranks of `group`."""
    if is_distributed():
        with peers("waiting at a barrier"):
            dist.barrier(group=group)


def broadcast_object(obj: T, group: ProcessGroup | None = None) -> T:
    """Rank 0's `obj` on every rank. Called on: all ranks of `group`."""
    if not is_distributed():
        return obj
    box = [obj]
    with peers("waiting for rank 0"):
        src = dist.get_global_rank(group, 0) if group else 0
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def all_gather_object(obj: T, group: ProcessGroup | None = None) -> list[T]:
    """Every rank's `obj`, in rank order. Called on: all ranks of `group`."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    with peers("exchanging state with the other ranks"):
        dist.all_gather_object(out, obj, group=group)
    return out


def agree(error: BaseException | None, what: str, group: ProcessGroup | None = None) -> None:
    """Share each rank's outcome of a step; raise on every rank if any rank failed.

    The failing rank re-raises its own exception; the others raise `RankFailedError` naming
    the first failed rank, so no rank goes on into a collective its peers will never join.
    Called on: all ranks of `group`.
    """
    agree_gather(None, error, what, group)


def agree_gather(
    value: T, error: BaseException | None, what: str, group: ProcessGroup | None = None
) -> list[T]:
    """`agree` and `all_gather_object` of `value` in one round: every rank's `value`, in rank
    order, unless some rank failed `what` (then raised as `agree` raises).
    Called on: all ranks of `group`."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = all_gather_object((msg, value), group)
    if error is not None:
        raise error
    for rank, (m, _v) in enumerate(outcomes):
        if m is not None:
            raise RankFailedError(f"{what} failed on rank {rank}: {m}")
    return [v for _m, v in outcomes]


def run_on_rank0(fn: Callable[[], T], what: str, group: ProcessGroup | None = None) -> T:
    """Run `fn` on rank 0 only and give every rank its result, or raise its error everywhere.

    Called on: all ranks of `group`.
    """
    result: Any = None
    error: BaseException | None = None
    if get_rank(group) == 0:
        try:
            result = fn()
        except Exception as e:  # travels to the other ranks below
            error = e
    if not is_distributed():
        if error is not None:
            raise error
        return result
    payload = broadcast_object(
        (result, None if error is None else f"{type(error).__name__}: {error}"), group
    )
    if error is not None:
        raise error
    if payload[1] is not None:
        raise RankFailedError(f"{what} failed on rank 0: {payload[1]}")
    return payload[0]


def has_cpu_backend(group: ProcessGroup | None) -> bool:
    """True when `group` can run collectives on CPU tensors (gloo, or a mixed backend)."""
    if not is_distributed():
        return True
    backend = str(dist.get_backend(group)).lower()
    return "gloo" in backend or "cpu:" in backend


def new_cpu_group(timeout: float) -> ProcessGroup | None:
    """A new gloo group over all ranks for checkpoint traffic, with its own timeout.

    Called on: all ranks (creating a group is itself collective).
    """
    if not is_distributed():
        return None
    return dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout))


def destroy_group(group: ProcessGroup) -> None:
    """Destroy a group made by `new_cpu_group`; nothing if the job already tore down
    `torch.distributed` (which destroyed it with every other group).

    Called on: every rank of the group.
    """
    if dist.is_initialized() and group in dist.distributed_c10d._world.pg_map:
        dist.destroy_process_group(group)


def check_cpu_group(group: ProcessGroup | None) -> None:
    if not has_cpu_backend(group):
        raise ConfigurationError(
            f"the checkpointer's process group uses backend '{dist.get_backend(group)}', which "
            "cannot run collectives on CPU tensors; pass a gloo group "
            "(torch.distributed.new_group(backend='gloo')) or none to let trainckpt create one"
        )
