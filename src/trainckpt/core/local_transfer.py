"""Point-to-point copies of local-tier parts between ranks, in bounded chunks.

Every rank of the group calls `exchange` with the same list of transfers (each: a source rank,
a destination rank and a byte count known to both). The bytes go in rounds: in each round every
unfinished transfer moves one chunk of at most `chunk` bytes (gloo `isend`/`irecv`, tagged by
the transfer's index, all posted before any is waited for, so no pair of ranks waits on each
other). Memory per rank is one chunk per transfer it takes part in, whatever the part's size.

A source that cannot read its bytes sends zeros of the same length (the receiver's CRC32C check
then fails) so the rounds never fall out of step; each side reports its own failures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as tdist

from trainckpt.core import dist
from trainckpt.faults import fault_point

log = logging.getLogger(__name__)

CHUNK = 16 << 20
"""Bytes per transfer per round."""


@dataclass(frozen=True)
class Transfer:
    """`size` bytes from rank `src` to rank `dst` (ranks of the group); `owner` names the part."""

    src: int
    dst: int
    owner: int
    size: int


class Source(Protocol):
    def readinto(self, buf: memoryview) -> int:
        """Fill `buf` (fewer bytes only at the end of the stream); return the count."""
        ...

    def close(self) -> None: ...


class Sink(Protocol):
    def write(self, data: memoryview) -> None: ...

    def close(self) -> None: ...


def exchange(
    transfers: Sequence[Transfer],
    group: dist.ProcessGroup | None,
    open_source: Callable[[Transfer], Source],
    open_sink: Callable[[Transfer], Sink],
    *,
    chunk: int = CHUNK,
) -> dict[int, BaseException]:
    """Run `transfers`; return this rank's failures by transfer index (an empty dict: every
    transfer this rank sent or received went through its source and sink without error —
    the receiver still checks the CRC32C). A dead peer raises `RankFailedError`.

    Called on: all ranks of `group`, with the same `transfers`."""
    rank = dist.get_rank(group)
    errors: dict[int, BaseException] = {}
    sources: dict[int, Source | None] = {}
    sinks: dict[int, Sink | None] = {}
    for i, t in enumerate(transfers):
        if t.src == rank:
            sources[i] = _open(open_source, t, i, errors)
        if t.dst == rank:
            sinks[i] = _open(open_sink, t, i, errors)
    rounds = max((-(-t.size // chunk) for t in transfers), default=0)
    try:
        for r in range(rounds):
            ops: list[tuple[int, torch.Tensor, bool]] = []
            for i, t in enumerate(transfers):
                n = min(chunk, t.size - r * chunk)
                if n <= 0:
                    continue
                if i in sources:
                    ops.append((i, _read_chunk(sources, i, n, errors), True))
                if i in sinks:
                    ops.append((i, torch.empty(n, dtype=torch.uint8), False))
            _send_and_receive(transfers, ops, group)
            for i, buf, is_send in ops:
                if not is_send and sinks.get(i) is not None:
                    try:
                        sinks[i].write(memoryview(buf.numpy().data))  # type: ignore[union-attr]
                    except Exception as e:  # keep receiving: the rounds must stay in step
                        errors[i] = e
                        _close_quietly(sinks[i])
                        sinks[i] = None
            if r == 0:
                fault_point("local-replicating")
    finally:
        for i, stream in [*sources.items(), *sinks.items()]:
            if stream is not None:
                try:
                    stream.close()
                except Exception as e:
                    errors.setdefault(i, e)
    return errors


def _open(opener: Callable[[Transfer], Source | Sink], t: Transfer, i: int, errors: dict) -> Any:
    try:
        return opener(t)
    except Exception as e:
        errors[i] = e
        return None


def _read_chunk(
    sources: dict[int, Source | None], i: int, n: int, errors: dict[int, BaseException]
) -> torch.Tensor:
    """The next `n` bytes of transfer `i`'s source, or zeros once it failed."""
    src = sources[i]
    if src is not None:
        try:
            buf = torch.empty(n, dtype=torch.uint8)
            got = src.readinto(memoryview(buf.numpy().data))
            if got != n:
                raise EOFError(f"expected {n} more bytes, the file ended after {got}")
            return buf
        except Exception as e:
            errors[i] = e
            sources[i] = None
    return torch.zeros(n, dtype=torch.uint8)


def _send_and_receive(
    transfers: Sequence[Transfer],
    ops: list[tuple[int, torch.Tensor, bool]],
    group: dist.ProcessGroup | None,
) -> None:
    if not ops:
        return
    with dist.peers("copying local checkpoint parts between ranks"):
        works = []
        for i, buf, is_send in ops:
            t = transfers[i]
            peer = t.dst if is_send else t.src
            peer = tdist.get_global_rank(group, peer) if group is not None else peer
            op = tdist.isend if is_send else tdist.irecv
            works.append(op(buf, peer, group=group, tag=i))
        for w in works:
            if w is not None:
                w.wait()


def _close_quietly(stream: Source | Sink | None) -> None:
    """Close a stream that already failed (its first error is the one reported)."""
    try:
        if stream is not None:
            stream.close()
    except Exception as e:
        log.debug("closing a failed transfer stream: %s", e)
