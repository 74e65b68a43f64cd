"""The interpreter's switch interval is short while a background save runs, and the trainer's
own value comes back afterwards (or stays, if the trainer set one meanwhile)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.models import make_module

from trainckpt import Checkpointer
from trainckpt.core.switch_interval import INTERVAL, short_switch_interval


@pytest.fixture
def interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def test_nested_blocks_restore_the_interval_once_the_last_ends(interval: None) -> None:
    sys.setswitchinterval(0.004)
    with short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(INTERVAL)
        with short_switch_interval():
            pass
        assert sys.getswitchinterval() == pytest.approx(INTERVAL)  # the outer block still runs
    assert sys.getswitchinterval() == pytest.approx(0.004)


def test_a_value_set_during_the_block_is_kept(interval: None) -> None:
    with short_switch_interval():
        sys.setswitchinterval(0.002)
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_a_shorter_interval_is_left_as_it_is(interval: None) -> None:
    sys.setswitchinterval(INTERVAL / 2)
    with short_switch_interval():
        assert sys.getswitchinterval() == pytest.approx(INTERVAL / 2)
    assert sys.getswitchinterval() == pytest.approx(INTERVAL / 2)


def test_a_background_save_runs_with_the_short_interval_and_restores_it(
    ckpt: Checkpointer, tmp_path: Path, interval: None
) -> None:
    sys.setswitchinterval(0.005)
    module = make_module(width=16)
    seen: list[float] = []
    future = ckpt.save_async(tmp_path / "step1", module, {"step": 1}, overlap_staging=True)
    while not future.done():  # the future resolves only after the save thread's block ended
        seen.append(sys.getswitchinterval())
    future.result()
    assert min(seen) == pytest.approx(INTERVAL)
    assert sys.getswitchinterval() == pytest.approx(0.005)
