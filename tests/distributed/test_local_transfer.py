"""The pipelined point-to-point exchange of the local tier (`local/transfer.py`) on 3 real
gloo ranks: every rank sends to and receives from every other, several transfers per pair and
direction, sizes around the chunk boundaries, 1 to 3 chunks in flight. Every received byte is
compared with what its source produced; broken sources and sinks must cost only their own
transfer (zeros of the same length, so the others stay in step) and be reported by their own
side."""

from __future__ import annotations

import hashlib

import pytest
from support.multiproc import run_ranks

pytestmark = pytest.mark.slow

CHUNK = 8192
SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 5 * CHUNK + 17]


def _bytes(index: int, size: int) -> bytes:
    """The deterministic content of transfer `index`."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{index}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


class _Source:
    """Transfer `index`'s bytes; fails (raises) once `fail_after` bytes were read."""

    def __init__(self, index: int, size: int, fail_after: int | None) -> None:
        self.data, self.pos, self.fail_after = _bytes(index, size), 0, fail_after

    def readinto(self, buf: memoryview) -> int:
        if self.fail_after is not None and self.pos >= self.fail_after:
            raise OSError(f"read error in transfer source after {self.pos} bytes")
        n = min(len(buf), len(self.data) - self.pos)
        buf[:n] = self.data[self.pos : self.pos + n]
        self.pos += n
        return n

    def close(self) -> None:
        pass


class _Sink:
    def __init__(self, fail_at_write: int | None) -> None:
        self.data, self.writes, self.fail_at_write, self.closed = bytearray(), 0, fail_at_write, 0

    def write(self, data: memoryview) -> None:
        self.writes += 1
        if self.writes == self.fail_at_write:
            raise OSError("disk full (from the test)")
        self.data += data

    def close(self) -> None:
        self.closed += 1


def _transfers(world: int) -> list:
    from trainckpt.local.transfer import Transfer

    out = []
    for src in range(world):
        for k in range(1, world):
            dst = (src + k) % world
            for size in SIZES:  # every size on every pair and direction: many per pair
                out.append(Transfer(src=src, dst=dst, owner=src, size=size))
    return out


def _exchange(rank: int, world: int, depth: int, broken: dict) -> dict:
    """Run the exchange with the sources and sinks `broken` names failing; return what this
    rank received (as hex digests and lengths) and its failures."""
    from trainckpt.local.transfer import exchange

    transfers = _transfers(world)
    sinks: dict[int, _Sink] = {}

    def open_source(t):  # noqa: ANN001, ANN202
        i = transfers.index(t)
        if i in broken.get("open_source", ()):
            raise OSError("cannot open the part (from the test)")
        return _Source(i, t.size, broken.get("source", {}).get(i))

    def open_sink(t):  # noqa: ANN001, ANN202
        i = transfers.index(t)
        sinks[i] = _Sink(broken.get("sink", {}).get(i))
        return sinks[i]

    errors = exchange(transfers, None, open_source, open_sink, chunk=CHUNK, depth=depth)
    return {
        "received": {i: bytes(s.data) for i, s in sinks.items()},
        "closed": {i: s.closed for i, s in sinks.items()},
        "errors": {i: f"{type(e).__name__}: {e}" for i, e in errors.items()},
    }


def _index(world: int, src: int, dst: int, size: int) -> int:
    for i, t in enumerate(_transfers(world)):
        if (t.src, t.dst, t.size) == (src, dst, size):
            return i
    raise AssertionError("no such transfer")


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_every_byte_arrives_whatever_the_size_and_depth(depth: int):
    world = 3
    results = run_ranks(_exchange, world, depth, {})
    transfers = _transfers(world)
    for rank, res in enumerate(results):
        assert res["errors"] == {}
        mine = [i for i, t in enumerate(transfers) if t.dst == rank]
        assert sorted(res["received"]) == mine
        for i in mine:
            assert res["received"][i] == _bytes(i, transfers[i].size), f"transfer {i}"
            assert res["closed"][i] == 1


def test_broken_sources_and_sinks_cost_only_their_own_transfer():
    world = 3
    src_fail = _index(world, 0, 1, 5 * CHUNK + 17)  # fails after 2 of its 6 chunks
    opened = _index(world, 2, 0, CHUNK + 1)  # cannot even be opened
    sink_fail = _index(world, 1, 2, 5 * CHUNK + 17)  # the receiver's 3rd write fails
    broken = {"source": {src_fail: 2 * CHUNK}, "open_source": [opened], "sink": {sink_fail: 3}}
    results = run_ranks(_exchange, world, 2, broken)
    transfers = _transfers(world)
    assert set(results[0]["errors"]) == {src_fail}  # each side reports its own failure
    assert set(results[2]["errors"]) == {opened, sink_fail}
    assert results[1]["errors"] == {}
    assert "read error" in results[0]["errors"][src_fail]
    assert "disk full" in results[2]["errors"][sink_fail]

    torn = results[1]["received"][src_fail]  # zeros from the failure on, same length
    want = _bytes(src_fail, transfers[src_fail].size)
    assert len(torn) == len(want) and torn[: 2 * CHUNK] == want[: 2 * CHUNK]
    assert torn[2 * CHUNK :] == bytes(len(want) - 2 * CHUNK)
    assert results[0]["received"][opened] == bytes(CHUNK + 1)
    assert (
        results[2]["received"][sink_fail]
        == _bytes(sink_fail, transfers[sink_fail].size)[: 2 * CHUNK]
    )
    for rank, res in enumerate(results):  # every other transfer intact, every sink closed
        for i, data in res["received"].items():
            assert res["closed"][i] == 1
            if i not in (src_fail, opened, sink_fail):
                assert data == _bytes(i, transfers[i].size), f"rank {rank}, transfer {i}"
