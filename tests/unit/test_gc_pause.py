"""Saving and loading thousands of entries pause Python's cyclic collector (core/gc_pause.py):
no automatic collection walks the heap during the bookkeeping, and the collector's state is
restored afterwards, also when the trainer had turned it off or two steps overlap."""

from __future__ import annotations

import gc
import threading
from pathlib import Path
from typing import Any

import torch

from trainckpt import CheckpointerConfig, ModelAndOptim
from trainckpt.core.gc_pause import paused_gc


def _many_entries(experts: int = 200) -> ModelAndOptim:
    model = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(experts))
    optim = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    return ModelAndOptim(model, optim)


def test_almost_no_automatic_collection_during_a_save_or_a_load(tmp_path: Path) -> None:
    module = _many_entries()  # 1,600 entries: DCP allocates far more than 700 objects
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    collections: list[dict[str, Any]] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            collections.append(info)

    gc.callbacks.append(record)
    try:
        ckpt.save(tmp_path / "step1", module, {"step": 1})
        ckpt.load(tmp_path / "step1", module)
    finally:
        gc.callbacks.remove(record)
        ckpt.close()
    # Without the pause: ~340 collections (some of the whole heap). The few left happen
    # outside the bookkeeping (trainer state, records).
    assert len(collections) <= 10, [c["generation"] for c in collections]
    assert gc.isenabled()


def test_the_collector_state_is_restored_and_overlapping_pauses_are_counted() -> None:
    assert gc.isenabled()
    first, second = threading.Event(), threading.Event()

    def background_pause() -> None:
        with paused_gc():
            first.set()
            second.wait(10)

    t = threading.Thread(target=background_pause)
    t.start()
    first.wait(10)
    with paused_gc():
        assert not gc.isenabled()
    assert not gc.isenabled()  # the background pause still holds it
    second.set()
    t.join()
    assert gc.isenabled()

    gc.disable()  # a trainer that manages collection itself
    try:
        with paused_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
