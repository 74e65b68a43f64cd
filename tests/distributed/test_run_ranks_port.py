"""The tests' rank launcher (`support.multiproc.run_ranks`) survives a rendezvous port that
another test worker took between picking it and binding it."""

from __future__ import annotations

import socket

import pytest
from support import multiproc
from support.ports import free_port


def _rank(rank: int, world_size: int) -> int:
    return rank * 10


def test_a_taken_rendezvous_port_is_tried_again_with_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        ports = iter([busy])
        picked: list[int] = []

        def pick() -> int:
            picked.append(next(ports, None) or free_port())
            return picked[-1]

        monkeypatch.setattr(multiproc, "free_port", pick)
        assert multiproc.run_ranks(_rank, 2) == [0, 10]
    assert picked[0] == busy and len(picked) == 2  # the taken port, then another
