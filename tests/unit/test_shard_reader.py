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
from trainckpt.core.dcp import load_state, plain_errors, save_state
from trainckpt.errors import CheckpointError
from trainckpt.format import shard_reader
from trainckpt.format.dcp_metadata import read_dcp_metadata
from trainckpt.format.shard_reader import (
    ParallelReader,
    _load_checked,
    _spans,
    _split_runs,
    reading_threads,
)
from trainckpt.storage.local import LocalStorage


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


# -- whole tensors copied into their targets (`_copy_into`) ----------------------------------


def _load_into(tmp_path: Path, out: dict[str, Any]) -> None:
    storage = LocalStorage()
    folder = str(tmp_path / "dcp")
    load_state(out, storage, folder, read_dcp_metadata(storage, folder), group=None)


def test_whole_tensors_land_in_every_kind_of_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many items of a kind (so most are copied by one memmove): each target gets its own
    values in place, cast where its dtype differs, through strides where it is not
    contiguous, at its offset where it is a view into a larger tensor (nothing around it
    written), and its version counter moves as `copy_` moves it."""
    moves: list[int] = []
    real = shard_reader._memmove
    monkeypatch.setattr(
        shard_reader, "_memmove", lambda dst, src, n: (moves.append(n), real(dst, src, n))[1]
    )
    state: dict[str, Any] = {}
    for i in range(6):
        state[f"a{i}"] = torch.randn(16, 16)
        state[f"b{i}"] = torch.randn(16, 16, dtype=torch.float64)
        state[f"c{i}"] = torch.randn(8, 4)
        state[f"d{i}"] = torch.randn(12).to(torch.bfloat16)
        state[f"e{i}"] = torch.tensor(float(i) + 0.5)
        state[f"f{i}"] = torch.randint(-100, 100, (9,))
        state[f"g{i}"] = torch.randn(16)
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    big = [torch.zeros(100) for _ in range(6)]
    out: dict[str, Any] = {}
    for i in range(6):
        out[f"a{i}"] = torch.zeros(16, 16)
        out[f"b{i}"] = torch.zeros(16, 16)  # float32: cast by copy_
        out[f"c{i}"] = torch.zeros(4, 8).t()  # not contiguous
        out[f"d{i}"] = torch.nn.Parameter(torch.zeros(12, dtype=torch.bfloat16))
        out[f"e{i}"] = torch.zeros(())
        out[f"f{i}"] = torch.zeros(18, dtype=torch.int64)[::2]  # strided
        out[f"g{i}"] = big[i][10:26]  # contiguous, at an offset in its storage
    targets = dict(out)
    versions = {k: v._version for k, v in out.items()}
    _load_into(tmp_path, out)
    for key, value in state.items():
        assert out[key] is targets[key]
        assert torch.equal(out[key], value.to(out[key].dtype)), key
        assert out[key]._version > versions[key], key
    for b in big:
        assert not b[:10].any() and not b[26:].any()
    assert moves  # the memmove path ran, for the kinds it may serve
    assert len(moves) < len(state) - 12  # not for the cast or strided targets


def test_a_whole_tensor_of_another_shape_is_refused_and_named(tmp_path: Path) -> None:
    state = {f"a{i}": torch.randn(16, 16) for i in range(8)}
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    out: dict[str, Any] = {f"a{i}": torch.zeros(16, 16) for i in range(8)}
    out["a5"] = torch.zeros(256)  # same bytes, other shape
    with pytest.raises(CheckpointError, match="a5"):
        _load_into(tmp_path, out)


def test_a_flipped_byte_in_one_of_many_alike_tensors_is_caught_and_named(tmp_path: Path) -> None:
    """Tensors read by the memmove path keep their CRC32C check: a flipped byte in the data
    (or outside it) of one of many alike items fails naming that item."""
    state = {f"a{i}": torch.randn(16, 16) for i in range(12)}
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    md = read_dcp_metadata(LocalStorage(), str(tmp_path / "dcp"))
    [info] = [s for i, s in md.storage_data.items() if i.fqn == "a9"]
    shard = tmp_path / "dcp" / info.relative_path
    good = shard.read_bytes()
    for where in (info.length - 300, 20):  # in the tensor's data, in its pickle's zip
        data = bytearray(good)
        data[info.offset + where] ^= 0x10
        shard.write_bytes(bytes(data))
        out: dict[str, Any] = {k: torch.zeros(16, 16) for k in state}
        with pytest.raises(CorruptCheckpointError) as caught:
            _load_into(tmp_path, out)
        assert "item 'a9'" in str(caught.value) and info.relative_path in str(caught.value)
