"""The parallel DCP read loop: every item read exactly once, on as many threads as its bytes
warrant, neighbouring items in one read and each still checked."""

from __future__ import annotations

import ctypes
import io
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.models import assert_same_state, fresh_module, make_module
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo

from trainckpt import CheckpointerConfig, CorruptCheckpointError
from trainckpt.core.dcp import plain_errors, save_state
from trainckpt.errors import CheckpointError
from trainckpt.format import shard_reader
from trainckpt.format.shard_reader import (
    ParallelReader,
    _load_checked,
    _spans,
    _split_runs,
    reading_threads,
)


def _reading_threads_seen(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """The names of the threads that load items from now on."""
    seen: set[str] = set()
    real = ParallelReader._read_run  # every item is loaded inside one of these, on its thread

    def recording(self: ParallelReader, run: list[Any], *args: object) -> None:
        if run:
            seen.add(threading.current_thread().name)
        real(self, run, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(ParallelReader, "_read_run", recording)
    return seen


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_load_on_several_threads_restores_every_tensor(
    tmp_path: Path, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shard_reader, "BYTES_PER_THREAD", 1)  # a thread for any bytes
    monkeypatch.setattr(shard_reader, "LARGE_ITEM_BYTES", 0)
    monkeypatch.setattr(shard_reader, "_SPAN_BYTES", 300)  # a few items per read
    seen = _reading_threads_seen(monkeypatch)
    src = make_module(width=48)
    ckpt = CheckpointerConfig(work_dir=tmp_path / "w", load_thread_count=threads).build()
    path = ckpt.save(tmp_path / "step1", src, {"step": 1})
    dst = fresh_module(width=48)
    ckpt.load(path, dst)
    ckpt.close()
    assert_same_state(src, dst)
    if threads == 1:
        assert seen == {threading.current_thread().name}
    else:
        assert seen and all(name.startswith("trainckpt-read") for name in seen)


def test_small_items_are_read_on_the_calling_thread(tmp_path: Path, monkeypatch) -> None:
    """Reading threads are chosen by the large items to read, not the configured count: a
    state of small items is read on the calling thread (threads would fight over the
    interpreter lock), with the same result."""
    seen = _reading_threads_seen(monkeypatch)
    src = make_module(width=48)
    ckpt = CheckpointerConfig(work_dir=tmp_path / "w", load_thread_count=4).build()
    path = ckpt.save(tmp_path / "step1", src, {"step": 1})
    dst = fresh_module(width=48)
    ckpt.load(path, dst)
    ckpt.close()
    assert_same_state(src, dst)
    assert seen == {threading.current_thread().name}
    mib = 2**20
    assert reading_threads([], 4) == 1
    assert reading_threads([1500] * 100_000, 4) == 1  # 150 MB of small items: no threads
    assert reading_threads([20 * mib], 4) == 1
    assert reading_threads([20 * mib, 20 * mib, 1500], 4) == 2
    assert reading_threads([2**30] * 4, 4) == 4
    assert reading_threads([2**30] * 4, 1) == 1


def test_runs_cover_every_item_once_in_order_and_balance_sizes() -> None:
    sizes = [50, 1, 1, 30, 30, 1, 40, 2, 45]
    runs = _split_runs(sizes, 3, size=lambda x: x)  # type: ignore[arg-type]
    assert [x for run in runs for x in run] == sizes
    assert len(runs) == 3
    assert max(sum(r) for r in runs) <= 100  # no run holds most of the bytes
    assert _split_runs([], 4, size=lambda x: x) == []  # type: ignore[arg-type]
    assert _split_runs([7], 4, size=lambda x: x) == [[7]]  # type: ignore[arg-type]


def test_spans_join_neighbouring_items_of_one_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_reader, "_SPAN_BYTES", 1000)
    monkeypatch.setattr(shard_reader, "_MAX_GAP", 10)
    places = [
        *[("a", 0, 100), ("a", 100, 100), ("a", 100, 100), ("a", 205, 100)],  # joined
        ("a", 400, 100),  # after a gap of 95 bytes
        ("a", 500, 450),
        ("a", 950, 500),  # 1,050 bytes from the span's start
        ("a", 1450, 5000),  # larger than a span: alone
        ("b", 6450, 10),  # another file
    ]
    run = [(_StorageInfo(n, o, ln), i) for i, (n, o, ln) in enumerate(places)]
    found = list(_spans(run))  # type: ignore[arg-type]
    spans = [[i for _, i in span] for span, _ in found]
    assert spans == [[0, 1, 2, 3], [4, 5], [6], [7], [8]]
    assert [end for _, end in found] == [305, 950, 1450, 6450, 6460]
    assert list(_spans([])) == []


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


def _small_state() -> dict[str, object]:
    state: dict[str, object] = {f"t{i}": torch.full((16,), float(i)) for i in range(40)}
    state.update({f"n{i}": i % 3 for i in range(10)})
    return state


def _blank(state: dict[str, object]) -> dict[str, object]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else -1 for k, v in state.items()}


@pytest.mark.parametrize("span_bytes", [1, 700, 2**22])
def test_items_read_together_or_alone_load_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, span_bytes: int
) -> None:
    """Whatever the span, and with the items this load skips leaving gaps, each item gets its
    own bytes."""
    monkeypatch.setattr(shard_reader, "_SPAN_BYTES", span_bytes)
    state = _small_state()
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    save_id = FileSystemReader(str(tmp_path / "dcp")).read_metadata().storage_meta.save_id
    wanted = {k: v for i, (k, v) in enumerate(state.items()) if i % 3 != 1}
    out = _blank(wanted)
    dcp.load(out, storage_reader=ParallelReader(tmp_path / "dcp", 1, save_id), no_dist=True)
    for key, value in wanted.items():
        assert (
            torch.equal(out[key], value) if isinstance(value, torch.Tensor) else out[key] == value
        )


def test_a_damaged_item_read_with_its_neighbours_is_caught_and_named(tmp_path: Path) -> None:
    """One flipped byte in one small item among many read in one read: the load fails naming
    that item and its file, and the neighbours' checks do not hide it."""
    state = _small_state()
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    md = FileSystemReader(str(tmp_path / "dcp")).read_metadata()
    [info] = [s for i, s in md.storage_data.items() if i.fqn == "t17"]
    shard = tmp_path / "dcp" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    reader = ParallelReader(tmp_path / "dcp", thread_count=4, save_id=md.storage_meta.save_id)
    with pytest.raises(CorruptCheckpointError) as caught, plain_errors("", CheckpointError):
        dcp.load(_blank(state), storage_reader=reader, no_dist=True)
    assert "item 't17'" in str(caught.value) and info.relative_path in str(caught.value)
