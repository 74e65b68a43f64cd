"""The parallel DCP read loop: every item read exactly once, on several threads."""

from __future__ import annotations

import ctypes
import io
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.models import assert_same_state, fresh_module, make_module
from torch.distributed.checkpoint import FileSystemReader

from trainckpt import CheckpointerConfig
from trainckpt.core.dcp import save_state
from trainckpt.format import shard_reader
from trainckpt.format.shard_reader import ParallelReader, _load_checked, _split_runs


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


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.int64, torch.bool]


@pytest.mark.parametrize("dtype", [*_DTYPES, torch.complex64])
def test_a_checked_item_becomes_a_tensor_on_its_checked_bytes(dtype: torch.dtype) -> None:
    """The checked load builds the tensor on the buffer whose CRC32C was checked (no second
    copy), with torch.load's result; read-only bytes are loaded by torch.load itself."""
    value = (torch.randn(37, 5) * 50).to(dtype)
    saved = io.BytesIO()
    torch.save(value, saved)
    buffer = bytearray(saved.getvalue())
    tensor = _load_checked(memoryview(buffer))
    assert tensor.dtype == dtype and torch.equal(tensor, value)
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert start <= tensor.data_ptr() < start + len(buffer)  # a view of the checked bytes
    copied = _load_checked(bytes(buffer))
    assert torch.equal(copied, value)


def test_checked_load_of_every_dtype_shape_and_scalar(tmp_path: Path) -> None:
    """End to end through the item checks: each item equals what was saved."""
    state: dict[str, object] = {
        f"t_{str(d).split('.')[-1]}": (torch.randn(129, 3) * 50).to(d) for d in _DTYPES
    }
    state["scalar"] = torch.tensor(2.5)
    state["empty"] = torch.zeros(0, 4)
    state["n"] = 7
    save_state(state, tmp_path / "dcp", group=None, thread_count=2)
    save_id = FileSystemReader(str(tmp_path / "dcp")).read_metadata().storage_meta.save_id
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}
    reader = ParallelReader(tmp_path / "dcp", thread_count=2, save_id=save_id)
    dcp.load(out, storage_reader=reader, no_dist=True)
    for key, value in state.items():
        assert (
            torch.equal(out[key], value) if isinstance(value, torch.Tensor) else out[key] == value
        )


def test_items_of_one_kind_have_their_pickle_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checked load reads an item's pickle only for the first of its kind; the others are
    recognized by their bytes outside the storage. Kinds of the same byte length are not
    mixed up, and items with a zip CRC32 (foreign, never alike) still load right."""
    monkeypatch.setattr(shard_reader, "_SKELETONS", shard_reader._Skeletons())
    pickles: list[object] = []
    real_load = torch.load

    def counting_load(*args: object, **kwargs: object) -> object:
        pickles.append(args[0])
        return real_load(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(shard_reader.torch, "load", counting_load)
    kinds = [
        lambda: torch.randn(16, 16),
        lambda: torch.randn(16, 16).t(),  # same bytes and length, other strides
        lambda: torch.randn(8, 32),
        lambda: torch.randn(256),
        lambda: torch.tensor(2.0),
    ]
    for crc in (False, True):
        torch.serialization.set_crc32_options(crc)
        try:
            values = [make() for _ in range(6) for make in kinds]
            items = []
            for value in values:
                saved = io.BytesIO()
                torch.save(value, saved)
                items.append(bytearray(saved.getvalue()))
        finally:
            torch.serialization.set_crc32_options(True)
        pickles.clear()
        for value, item in zip(values, items, strict=True):
            loaded = _load_checked(memoryview(item))
            assert loaded.shape == value.shape and loaded.stride() == value.stride()
            assert torch.equal(loaded, value)
        if not crc:
            assert len(pickles) == len(kinds)  # once per kind
