"""The load planner's search of trainckpt's own metadata (`native_metadata.read_items`): for a
tensor whose chunks stay in the chunk table, the read items of a rank's shard are exactly
those DCP's own search (`create_read_items_for_chunk_list`) plans, in the same order."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from trainckpt.core.dcp import _SafeLoadPlanner
from trainckpt.format import native_metadata


def _split(n: int, parts: int, rng: random.Random, empty: bool) -> list[tuple[int, int]]:
    """`n` split into up to `parts` (offset, size) pieces; with `empty`, some may be empty
    (a rank's shard of an uneven split), else all have distinct offsets (saved chunks)."""
    if empty:
        cuts = sorted(rng.randint(0, n) for _ in range(parts - 1))
    else:
        cuts = sorted(rng.sample(range(1, n), min(parts, n) - 1))
    bounds = [0, *cuts, n]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:], strict=False)]


def _grid(
    size: list[int], parts: list[int], rng: random.Random, empty: bool = False
) -> list[ChunkStorageMetadata]:
    """Chunks tiling a tensor of `size`, `parts[d]` along each dimension (shuffled)."""
    chunks = [ChunkStorageMetadata(torch.Size([]), torch.Size([]))]
    for n, p in zip(size, parts, strict=True):
        chunks = [
            ChunkStorageMetadata(torch.Size([*c.offsets, o]), torch.Size([*c.sizes, s]))
            for c in chunks
            for o, s in _split(n, p, rng, empty)
        ]
    rng.shuffle(chunks)
    return chunks


def _metadata(size: list[int], chunks: list[ChunkStorageMetadata]) -> Metadata:
    fqn = "w"
    storage = {
        MetadataIndex(fqn, c.offsets, i): _StorageInfo(f"__{i % 3}_0.distcp", i * 64, 64)
        for i, c in enumerate(chunks)
    }
    entry = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size(size), chunks)
    return Metadata({fqn: entry}, storage_data=storage)


def _exact(items: list[ReadItem]) -> list[tuple[Any, ...]]:
    """Each item's fields, with the index hints (which `MetadataIndex` equality ignores)."""
    return [
        (
            i.type,
            i.dest_index,
            i.dest_index.index,
            i.dest_offsets,
            i.storage_index,
            i.storage_index.index,
            i.storage_offsets,
            i.lengths,
        )
        for i in items
    ]


SHAPES = {  # (size range, saved parts range) per dimension: more than LAZY_CHUNKS chunks
    1: [((100, 300), (65, 99))],
    2: [((20, 40), (9, 15)), ((10, 20), (8, 10))],
    3: [((10, 16), (5, 8)), ((6, 10), (4, 6)), ((4, 8), (3, 4))],
}


@pytest.mark.parametrize("seed", range(40))
def test_the_items_are_dcps_items(seed: int) -> None:
    rng = random.Random(seed)
    dims = SHAPES[rng.choice([1, 2, 2, 3])]
    if rng.random() < 0.5:
        dims = dims[::-1]  # the sweep along another dimension
    size = [rng.randint(*n) for n, _ in dims]
    saved = _grid(size, [rng.randint(*p) for _, p in dims], rng)
    assert len(saved) > native_metadata.LAZY_CHUNKS
    md = _metadata(size, saved)
    data = native_metadata.encode(md)
    assert data is not None
    decoded = native_metadata.decode(data, "rec")
    entry = decoded.state_dict_metadata["w"]
    assert isinstance(entry.chunks, native_metadata.LazyChunks)
    for _ in range(4):
        local = _grid(size, [rng.randint(1, 4) for _ in size], rng, empty=True)
        local = local[: rng.randint(1, 5)]
        want = create_read_items_for_chunk_list("w", md.state_dict_metadata["w"], local)
        got = native_metadata.read_items("w", entry, local)
        assert got is not None
        assert _exact(got) == _exact(want)
        for item in got:  # every item's stored piece is found, as the reader looks it up
            assert decoded.storage_data[item.storage_index] == md.storage_data[item.storage_index]


def test_chunks_of_another_rank_count_are_left_to_dcp() -> None:
    rng = random.Random(0)
    saved = _grid([200, 4], [100, 1], rng)
    assert len(saved) == 100
    data = native_metadata.encode(_metadata([200, 4], saved))
    assert data is not None
    entry = native_metadata.decode(data, "rec").state_dict_metadata["w"]
    wrong = [ChunkStorageMetadata(torch.Size([0]), torch.Size([10]))]  # one dimension, not two
    assert native_metadata.read_items("w", entry, wrong) is None
    assert native_metadata.read_items("w", entry, []) == []
    pickled = TensorStorageMetadata(entry.properties, entry.size, list(entry.chunks))
    assert native_metadata.read_items("w", pickled, wrong) is None  # not kept in the table


class _Shard(torch.Tensor):
    """A rank's shard, as DCP's planner sees a DTensor: global size and its chunks."""

    _global: torch.Size
    _chunks: list[ChunkStorageMetadata]

    def size(self, dim: Any = None) -> Any:  # type: ignore[override]
        return self._global if dim is None else self._global[dim]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self._chunks


def _shard(size: list[int], chunks: list[ChunkStorageMetadata]) -> _Shard:
    shard = torch.Tensor._make_subclass(_Shard, torch.empty(0))
    shard._global, shard._chunks = torch.Size(size), chunks
    return shard  # type: ignore[no-any-return]


def test_the_load_planner_plans_from_the_table_as_dcp_does() -> None:
    """A rank's whole plan over many tensors sharded alike (the search's answer is reused
    from one to the next) equals DCP's plan of the same state on the pickled metadata."""
    rng = random.Random(1)
    saved = _grid([300, 8], [150, 1], rng)
    md = _metadata([300, 8], saved)
    entries = {f"t{t}": md.state_dict_metadata["w"] for t in range(6)}
    storage = {
        MetadataIndex(f"t{t}", k.offset, k.index): v
        for t in range(6)
        for k, v in md.storage_data.items()
    }
    md = Metadata(entries, storage_data=storage)
    data = native_metadata.encode(md)
    assert data is not None
    local = [ChunkStorageMetadata(torch.Size([70, 0]), torch.Size([45, 8]))]

    def plan(metadata: Metadata) -> list[ReadItem]:
        planner = _SafeLoadPlanner("ckpt", direct=True)
        planner.set_up_planner({k: _shard([300, 8], local) for k in entries}, metadata, False)
        return planner.create_local_plan().items

    decoded = native_metadata.decode(data, "rec")
    assert isinstance(decoded.state_dict_metadata["t0"].chunks, native_metadata.LazyChunks)
    got = plan(decoded)
    assert len(got) > 6 and _exact(got) == _exact(plan(md))
    with pytest.raises(ValueError, match="Size mismatch"):  # DCP's own error, unchanged
        planner = _SafeLoadPlanner("ckpt", direct=True)
        planner.set_up_planner({"t0": _shard([301, 8], local)}, decoded, False)
        planner.create_local_plan()
