"""The fast DCP writer: same files as DCP's, CRC32C computed while writing, parallel shards."""

from __future__ import annotations

import filecmp
import io
import json
import threading
import tracemalloc
import zipfile
from collections.abc import Iterator
from pathlib import Path

import google_crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from support.damage import split_item_record
from support.models import assert_same_state, fresh_module, make_module
from torch.distributed.checkpoint import FileSystemReader

from trainckpt import CheckpointerConfig
from trainckpt.core.dcp import save_state
from trainckpt.format import content_hash, shard_checksums, shard_writer, tensor_item
from trainckpt.format.layout import DCP_METADATA_FILE, NATIVE_METADATA_FILE
from trainckpt.storage.checksums import crc32c_file


def test_shards_written_in_parallel_carry_the_crc32c_of_their_bytes(tmp_path: Path) -> None:
    module = make_module(width=64)
    entries = save_state(module.state_dict_to_save(), tmp_path / "dcp", group=None, thread_count=4)
    shards = sorted((tmp_path / "dcp").glob("*.distcp"))
    assert len(shards) == 4  # one file per writer thread
    records = {f"dcp/{DCP_METADATA_FILE}", f"dcp/{NATIVE_METADATA_FILE}"}
    assert set(entries) == {f"dcp/{p.name}" for p in shards} | records
    for rel, entry in entries.items():
        assert entry == crc32c_file(tmp_path / rel), rel  # re-read from disk: same size and CRC


def test_files_load_with_plain_dcp(tmp_path: Path) -> None:
    src = make_module()
    save_state(src.state_dict_to_save(), tmp_path / "dcp", group=None, thread_count=2)
    dst = fresh_module()
    state = dst.state_dict_to_save()
    dcp.load(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    dst.load_state_dict(state)
    assert_same_state(src, dst)


def test_a_view_is_written_without_the_rest_of_its_storage(tmp_path: Path) -> None:
    big = torch.arange(1_000_000, dtype=torch.float32)
    view = big[10:20]
    save_state({"v": view, "n": 3}, tmp_path / "dcp", group=None, thread_count=1)
    size = sum(p.stat().st_size for p in (tmp_path / "dcp").glob("*.distcp"))
    assert size < 10_000  # not the 4 MB storage behind the view
    out = {"v": torch.zeros(10), "n": 0}
    dcp.load(out, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(out["v"], view) and out["n"] == 3


def test_a_rank_with_nothing_to_write_writes_no_shard(tmp_path: Path) -> None:
    entries = save_state({}, tmp_path / "dcp", group=None, thread_count=2)
    assert sorted(entries) == [f"dcp/{DCP_METADATA_FILE}", f"dcp/{NATIVE_METADATA_FILE}"]
    assert not list((tmp_path / "dcp").glob("*.distcp"))


def test_async_save_is_byte_identical_to_sync_save(tmp_path: Path) -> None:
    """save_async returns once staged; changing the model right after must not change a byte."""
    # incremental=False: the second save would take the first one's (equal) files over
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", incremental=False).build()
    module = make_module(width=64)
    sync_dir = Path(ckpt.save(tmp_path / "sync" / "step1", module, {"step": 1}))
    future = ckpt.save_async(tmp_path / "async" / "step1", module, {"step": 1})
    with torch.no_grad():
        for p in module.model.parameters():
            p.mul_(-3.0)  # the trainer steps while the save is still writing
    async_dir = Path(future.result())
    ckpt.close()

    sync_files = json.loads((sync_dir / ".manifest.json").read_text())["files"]
    async_files = json.loads((async_dir / ".manifest.json").read_text())["files"]
    assert sync_files.keys() == async_files.keys()
    compared = 0
    for rel in sync_files:
        if rel.endswith((f"/{DCP_METADATA_FILE}", f"/{NATIVE_METADATA_FILE}")):  # hold the save id
            continue
        if rel.endswith(".distcp"):  # so does each shard's item record: compare the rest
            sync_items, sync_record = split_item_record(sync_dir / rel)
            async_items, async_record = split_item_record(async_dir / rel)
            assert sync_items == async_items and sync_record["items"] == async_record["items"]
            assert sync_record["save_id"] != async_record["save_id"]
        else:
            assert filecmp.cmp(sync_dir / rel, async_dir / rel, shallow=False), rel
            assert sync_files[rel] == async_files[rel]
        compared += 1
    assert compared >= 2  # trainer state and at least one shard


def test_each_item_is_torch_save_without_the_zip_crc32_and_torch_load_reads_it(
    tmp_path: Path,
) -> None:
    """Items skip the zip CRC32 (our CRC32C covers every byte); `torch.load` reads each one."""
    state = {f"t{i}": torch.randn(1000 + i, dtype=torch.float32) for i in range(6)}
    state["i"] = torch.arange(50, dtype=torch.int64)
    save_state(state, tmp_path / "dcp", group=None, thread_count=2)
    storage = FileSystemReader(str(tmp_path / "dcp")).read_metadata().storage_data
    assert {index.fqn for index in storage} == set(state)
    torch.serialization.set_crc32_options(False)
    try:
        for index, info in storage.items():
            with open(tmp_path / "dcp" / info.relative_path, "rb") as f:
                f.seek(info.offset)
                item = f.read(info.length)
            expected = io.BytesIO()
            torch.save(state[index.fqn], expected)
            assert item == expected.getvalue(), index.fqn
            loaded = torch.load(io.BytesIO(item), weights_only=True)
            assert torch.equal(loaded, state[index.fqn])
    finally:
        torch.serialization.set_crc32_options(True)


def test_a_torch_save_on_another_thread_keeps_its_zip_crc32(tmp_path: Path) -> None:
    """Skipping the CRC32 in our items must not leak into a trainer's own `torch.save`."""
    state = {f"t{i}": torch.randn(1 << 20) for i in range(8)}  # the writes release the GIL
    stop = threading.Event()

    def save_repeatedly() -> None:
        for n in range(4):
            save_state(state, tmp_path / f"dcp{n}", group=None, thread_count=2)
        stop.set()

    saver = threading.Thread(target=save_repeatedly)
    saver.start()
    checked = 0
    while not stop.is_set() or checked == 0:
        buffer = io.BytesIO()
        torch.save({"w": torch.randn(100)}, buffer)
        assert zipfile.ZipFile(buffer).testzip() is None  # every entry has its CRC32
        checked += 1
    saver.join()
    assert torch.serialization.get_crc32_options()


def test_tensors_of_one_kind_are_serialized_once_and_written_as_torch_save_would(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thousands of small tensors: only the first of each kind (dtype, shape, strides, storage)
    goes through torch.save's serializer; the others are written from its head and tail, and
    every item still has exactly torch.save's bytes (zip CRC32 off)."""
    serialized: list[torch.Tensor] = []
    real = tensor_item.save_item
    monkeypatch.setattr(
        tensor_item, "save_item", lambda t, out: (serialized.append(t), real(t, out))
    )
    monkeypatch.setattr(tensor_item, "_TEMPLATES", tensor_item.ItemTemplates())
    kinds = [
        lambda: torch.randn(16, 16),
        lambda: torch.randn(16, 16).t().contiguous().t(),  # other strides, same shape
        lambda: torch.randn(8, 32),  # same byte count, other shape
        lambda: (torch.randn(5, 3) * 9).to(torch.bfloat16),
        lambda: torch.randn(7) > 0,
        lambda: torch.tensor(3.0),  # an optimizer step counter
        lambda: torch.arange(11, dtype=torch.int64),
    ]
    items = [make() for _ in range(5) for make in kinds]
    done = shard_writer.write_shard(tmp_path, "s.distcp", iter(items), "id", fsync=False)
    assert len(serialized) == len(kinds)  # once per kind, not once per tensor
    data = (tmp_path / "s.distcp").read_bytes()
    torch.serialization.set_crc32_options(False)
    try:
        for tensor, (offset, length) in zip(items, done.spans, strict=True):
            expected = io.BytesIO()
            torch.save(tensor, expected)
            assert data[offset : offset + length] == expected.getvalue()
            loaded = torch.load(io.BytesIO(data[offset : offset + length]), weights_only=True)
            assert torch.equal(loaded, tensor) and loaded.stride() == tensor.stride()
    finally:
        torch.serialization.set_crc32_options(True)


def test_digests_of_the_small_tensors_are_those_of_the_bytes_in_the_file(tmp_path: Path) -> None:
    """Asked for digests, the writer returns one per item in order: for a small tensor the
    xxh3-128 of its item's bytes as they are in the file (what an incremental save compares),
    equal for equal items and different for the same values in another shape; None for a
    byte item and a large tensor, which it writes another way."""
    small = torch.arange(64, dtype=torch.float32)
    items: list[object] = [
        b"a byte item",
        small,
        torch.zeros(1 << 19),  # 2 MiB: written through the serializer
        small.clone(),
        small.reshape(8, 8).clone(),
        b"another",
        torch.tensor(3.0),
    ]
    done = shard_writer.write_shard(tmp_path, "s.distcp", iter(items), "id", False, True)
    assert done.digests is not None and len(done.digests) == len(items)
    data = (tmp_path / "s.distcp").read_bytes()
    for item, digest, (offset, length) in zip(items, done.digests, done.spans, strict=True):
        if isinstance(item, bytes) or item.nbytes >= tensor_item.ItemTemplates.SMALL:
            assert digest is None
        else:
            assert digest == content_hash.item_digest(data[offset : offset + length])
    assert done.digests[1] == done.digests[3] != done.digests[4]
    assert shard_writer.write_shard(tmp_path, "t.distcp", iter(items), "id", False).digests is None


def test_one_rank_skips_the_deduplication_across_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With one rank there is nothing to deduplicate: DCP's `dedup_save_plans` (a hash of
    every item's index) is not called, and plain DCP still reads every value."""
    from torch.distributed.checkpoint import default_planner

    calls: list[int] = []
    real = default_planner.dedup_save_plans
    monkeypatch.setattr(
        default_planner,
        "dedup_save_plans",
        lambda plans, *a: (calls.append(len(plans)), real(plans, *a))[1],
    )
    state = {f"e{i}": torch.full((3,), float(i)) for i in range(20)} | {"n": 5}
    save_state(state, tmp_path / "dcp", group=None, thread_count=2)
    assert calls == []
    out = {k: torch.zeros(3) for k in state if k != "n"} | {"n": 0}
    dcp.load(out, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in state.items() if k != "n") and out["n"] == 5


def test_small_items_written_together_each_keep_their_place_and_crc32c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small items are gathered into batched writes (`_SmallItems`, here of 4 KiB), between
    items written on their own (a first tensor of its kind, a large one): every item's span
    and CRC32C in the item record are those of its bytes in the file. Equal small items (a
    flattened optimizer state's hyperparameters, equal step counters) share one place, also
    across batches; distinct ones never overlap, and nothing else is in the file."""
    monkeypatch.setattr(shard_writer._SmallItems, "BATCH", 4096)
    repeated = b"r" * 700  # a flattened optimizer state's equal hyperparameters
    step = torch.tensor(7.0)  # AdamW's step counters: equal small tensors
    items: list[shard_writer.ItemData] = []
    for i in range(12):
        items += [repeated, torch.randn(16, 16), f"value {i}".encode() * 40, repeated]
        items += [step.clone(), f"value {i % 3}".encode() * 40]
        if i == 5:
            items.append(torch.randn(300_000))  # over ItemTemplates.SMALL: written alone
    done = shard_writer.write_shard(tmp_path, "s.distcp", iter(items), "id", fsync=False)
    path = tmp_path / "s.distcp"
    data = path.read_bytes()
    with open(path, "rb") as f:
        record = shard_checksums.read(f, str(path))
    assert done.entry == crc32c_file(path)
    assert len(done.spans) == len(items)
    places: dict[tuple[int, int], bytes] = {}
    for item, (offset, length) in zip(items, done.spans, strict=True):
        part = data[offset : offset + length]
        assert record.items[offset] == (length, google_crc32c.value(part))
        if isinstance(item, bytes):
            assert part == item
        else:
            assert torch.equal(torch.load(io.BytesIO(part), weights_only=True), item)
        places[(offset, length)] = part
    assert sorted(set(record.items)) == sorted(o for o, _n in places)
    assert len(places) == len(set(places.values()))  # each distinct item once
    assert len([s for s in done.spans if s == done.spans[0]]) == 24  # `repeated`, shared
    end = 0
    for offset, length in sorted(places):  # the distinct items tile the data, in order
        assert offset == end
        end = offset + length
    assert data[end + 4 : end + 13] == b'{"file": '  # then the item record, nothing between
    assert len(data) == end + int.from_bytes(data[-16:-8], "little") + 16


def test_sharing_equal_small_items_keeps_memory_to_about_a_batch(tmp_path: Path) -> None:
    """Equal items share a place, but the bytes kept to find them are bounded: a file of 24 MB
    of distinct items just under `ItemTemplates.SMALL` (each handed over, then dropped by its
    producer) peaks at a few batches of memory, not the file's size."""
    size = 900_000

    def items() -> Iterator[bytes]:
        for i in range(28):
            yield bytes([i]) * size  # distinct, each made when its turn comes

    tracemalloc.start()
    try:
        done = shard_writer.write_shard(tmp_path, "s.distcp", items(), "id", fsync=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(set(done.spans)) == 28
    assert peak < 6 * shard_writer._SmallItems.BATCH, peak


def test_items_go_to_files_as_dcps_own_writer_splits_them() -> None:
    """`_buckets` splits a plan's items into files exactly as DCP's `_split_by_size_and_type`
    (byte items dealt in turn, tensors largest first to the emptiest file, ties to the first)."""
    import random

    from torch.distributed.checkpoint.filesystem import _split_by_size_and_type
    from torch.distributed.checkpoint.planner_helpers import _create_write_items

    rng = random.Random(0)
    state: dict[str, object] = {}
    for i in range(300):
        if rng.random() < 0.4:
            state[f"v{i}"] = rng.random()
        else:
            shape = [rng.choice([1, 2, 3, 16]) for _ in range(rng.randint(0, 3))]
            state[f"t{i}"] = torch.zeros(shape, dtype=rng.choice([torch.float32, torch.int8]))
    items = [wi for fqn, obj in state.items() for wi in _create_write_items(fqn, obj)]
    rng.shuffle(items)
    for bins in (1, 2, 3, 8):
        expected = [b for b in _split_by_size_and_type(bins, items) if b]
        assert [b for b in shard_writer._buckets(bins, items) if b] == expected, bins
