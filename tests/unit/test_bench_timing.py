"""The scale bench's alternating timer (`scripts/bench_scale.py`) times every contender alike:
the collector paused for the call and for dropping its result, the drop off the clock. (Its
reference once resumed the collector with its result alive and paid for a collection of it,
which made the safe unpickler's ratio read 1.37 where it was 1.69.) No time is measured here:
the clock is a fake one."""

from __future__ import annotations

import gc
import pickle
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_scale  # noqa: E402


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_call_is_timed_with_the_collector_paused_and_its_result_dropped_off_the_clock(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = _Clock()
    monkeypatch.setattr(bench_scale.time, "perf_counter", clock)
    events: list[tuple[str, bool]] = []

    class Result:
        def __del__(self) -> None:
            events.append(("drop", gc.isenabled()))
            clock.now += 100.0  # a costly drop: it must not land in any sample

    def call() -> Result:
        events.append(("call", gc.isenabled()))
        clock.now += 1.0
        return Result()

    assert gc.isenabled()
    report = bench_scale._alternated({"a": call, "b": call}, rounds=3, sampled_s=0.0)
    assert gc.isenabled()  # resumed after
    for name in "ab":
        assert report[name]["rounds"] == 3
        assert report[name]["min"] == report[name]["max"] == report[name]["s"] == 1.0
    timed = events[: 2 * (2 + 3 * 2)]  # two warm-up calls, three rounds of two, and their drops
    assert [kind for kind, _ in timed] == ["call", "drop"] * 8
    assert not any(enabled for _, enabled in timed)


@pytest.mark.parametrize("paused", [True, False])
def test_the_collecting_reference_leaves_the_collector_as_it_found_it(paused: bool) -> None:
    data = pickle.dumps({"a": [1, 2]})
    if paused:
        gc.disable()
    try:
        result: Any = bench_scale._collecting_loads(data)
        assert result == {"a": [1, 2]}
        assert gc.isenabled() is not paused
    finally:
        gc.enable()
