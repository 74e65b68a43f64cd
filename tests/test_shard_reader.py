"""The parallel DCP read loop: every item read exactly once, on several threads."""

from __future__ import annotations

from pathlib import Path

import pytest
from models import assert_same_state, fresh_module, make_module

from trainckpt import CheckpointerConfig
from trainckpt.shard_reader import _split_runs


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_load_on_several_threads_restores_every_tensor(tmp_path: Path, threads: int) -> None:
    src = make_module(width=48)
    ckpt = CheckpointerConfig(work_dir=tmp_path / "w", load_thread_count=threads).build()
    path = ckpt.save(tmp_path / "step1", src, {"step": 1})
    dst = fresh_module(width=48)
    ckpt.load(path, dst)
    ckpt.close()
    assert_same_state(src, dst)


def test_runs_cover_every_item_once_in_order_and_balance_sizes() -> None:
    sizes = [50, 1, 1, 30, 30, 1, 40, 2, 45]
    runs = _split_runs(sizes, 3, size=lambda x: x)  # type: ignore[arg-type]
    assert [x for run in runs for x in run] == sizes
    assert len(runs) == 3
    assert max(sum(r) for r in runs) <= 100  # no run holds most of the bytes
    assert _split_runs([], 4, size=lambda x: x) == []  # type: ignore[arg-type]
    assert _split_runs([7], 4, size=lambda x: x) == [[7]]  # type: ignore[arg-type]
