"""A save that plans from scratch builds DCP's plans itself (`plan_cache.local_save_plan`,
`global_save_plan`): the plans and the metadata must be DCP's own for the same state, DCP's
errors must still be raised, and what a multi-rank save writes this way must load bit-exactly
in plain DCP."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from support.multiproc import run_ranks
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

from trainckpt.core import plan_cache
from trainckpt.core.dcp import save_state


def _state() -> dict[str, Any]:
    """Every kind of entry a flat state holds: tensors of several dtypes, shapes (0-d, empty)
    and flags, and plain values."""
    p = torch.nn.Parameter(torch.randn(3, 4))
    return {
        "w": torch.randn(4, 8),
        "p": p,
        "half": torch.randn(5).to(torch.bfloat16),
        "step": torch.tensor(3.0),
        "empty": torch.zeros(0, 2),
        "ints": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "grad": torch.randn(2).requires_grad_(),
        "lr": 0.001,
        "betas": (0.9, 0.999),
        "name": "adamw",
        "none": None,
        "n": 7,
        "flag": True,
    }


def _dcp_plans(state: dict[str, Any], ranks: int) -> tuple[list[SavePlan], Any]:
    planner = DefaultSavePlanner()
    mappings = {k: (k,) for k in state}
    local = [
        dataclasses.replace(create_default_local_save_plan(state, r == 0), planner_data=mappings)
        for r in range(ranks)
    ]
    return planner._create_global_plan(local)  # type: ignore[no-any-return]


def _ours(state: dict[str, Any], ranks: int) -> tuple[list[SavePlan], Any]:
    planner = plan_cache.ReusingSavePlanner(0, ranks)
    mappings = {k: (k,) for k in state}
    local = [plan_cache.local_save_plan(state, mappings) for _ in range(ranks)]
    return planner._create_global_plan(local)  # type: ignore[no-any-return]


def test_the_local_plan_is_dcps_item_for_item() -> None:
    state = _state()
    mappings = {k: ("x", k) for k in state}
    ours = plan_cache.local_save_plan(state, mappings)
    dcp = create_default_local_save_plan(state, True)
    assert ours.planner_data is mappings
    assert len(ours.items) == len(dcp.items) == len(state)
    for a, b in zip(ours.items, dcp.items, strict=True):
        assert a == b and a.type == b.type and a.index.offset == b.index.offset
        if a.type == WriteItemType.BYTE_IO:  # built without a constructor: the very same object
            assert a.__dict__ == b.__dict__ and a.index.__dict__ == b.index.__dict__
            assert pickle.dumps(a) == pickle.dumps(b)
        else:
            assert a.tensor_data == b.tensor_data
            assert a.index.index == 0 and b.index.index is None  # the hint the global plan sets
    # properties are shared only between tensors of the same kind
    props = {id(i.tensor_data.properties): i for i in ours.items if i.tensor_data is not None}
    for item in ours.items:
        if item.tensor_data is not None:
            other = props[id(item.tensor_data.properties)]
            assert other.tensor_data is not None
            assert other.tensor_data.properties == item.tensor_data.properties


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_the_global_plan_and_metadata_are_dcps(ranks: int) -> None:
    state = _state()
    ours, md = _ours(state, ranks)
    theirs, dcp_md = _dcp_plans(state, ranks)
    assert md == dcp_md
    assert pickle.loads(pickle.dumps(md)) == dcp_md
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert a.items == b.items
        assert [i.index.index for i in a.items] == [i.index.index for i in b.items]
        assert a.planner_data == b.planner_data


def _shard(item: Any, offsets: list[int], sizes: list[int]) -> Any:
    return dataclasses.replace(
        item,
        type=WriteItemType.SHARD,
        index=MetadataIndex(item.index.fqn, torch.Size(offsets)),
        tensor_data=dataclasses.replace(
            item.tensor_data, chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
        ),
    )


def test_an_invalid_global_plan_is_refused_as_dcp_refuses_it() -> None:
    """Chunks out of bounds, overlapping across ranks or leaving a gap still fail DCP's
    validation, with DCP's message."""
    (item,) = plan_cache.local_save_plan({"w": torch.randn(4, 4)}, {"w": ("w",)}).items
    bad = {
        "out of bounds": [[_shard(item, [2, 0], [4, 4])]],
        "overlapping": [[_shard(item, [0, 0], [3, 4])], [_shard(item, [2, 0], [2, 4])]],
        "invalid fill": [[_shard(item, [0, 0], [1, 4])], [_shard(item, [2, 0], [2, 4])]],
    }
    for what, items in bad.items():
        plans = [SavePlan(i, planner_data={"w": ("w",)}) for i in items]
        with pytest.raises(ValueError, match=what) as ours:
            plan_cache.ReusingSavePlanner(0, len(plans))._create_global_plan(plans)
        with pytest.raises(ValueError) as theirs:
            DefaultSavePlanner()._create_global_plan(plans)
        assert str(ours.value) == str(theirs.value)
    # a repeated key that is not a shard: DCP's assertion
    with pytest.raises(AssertionError):
        plan_cache.global_save_plan([SavePlan([item, item], planner_data={})])


def _two_ranks_body(rank: int, world: int, root: str) -> dict[str, int]:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    plan_cache.forget()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)  # the same replicated values on every rank
    state: dict[str, Any] = {
        "model": {
            "w": torch.randn(6, 4),
            "d": distribute_tensor(torch.randn(8, 2), mesh, [Shard(0)]),
        },
        "optim": {"step": torch.tensor(5.0), "lr": 0.01, "betas": (0.9, 0.95)},
        f"rank{rank}": torch.full((3,), float(rank)),  # one entry per rank
    }
    before = dict(plan_cache.counts)
    save_state(state, Path(root) / "ckpt", group=None, thread_count=2, durable=False)
    tdist.barrier()
    return {k: v - before.get(k, 0) for k, v in plan_cache.counts.items() if v != before.get(k)}


def test_a_two_rank_save_planned_anew_loads_bit_exactly_in_plain_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    counts = run_ranks(_two_ranks_body, 2, str(tmp_path))
    assert counts[0]["local planned"] == 1 and counts[0]["global planned"] == 1
    torch.manual_seed(0)
    w, d = torch.randn(6, 4), torch.randn(8, 2)
    state: dict[str, Any] = {
        "model": {"w": torch.zeros(6, 4), "d": torch.zeros(8, 2)},
        "optim": {"step": torch.tensor(0.0), "lr": None, "betas": None},
        "rank0": torch.zeros(3),
        "rank1": torch.zeros(3),
    }
    dcp.load(state, checkpoint_id=tmp_path / "ckpt", no_dist=True)
    assert torch.equal(state["model"]["w"], w) and torch.equal(state["model"]["d"], d)
    assert torch.equal(state["optim"]["step"], torch.tensor(5.0))
    assert state["optim"]["lr"] == 0.01 and state["optim"]["betas"] == (0.9, 0.95)
    assert torch.equal(state["rank0"], torch.zeros(3))
    assert torch.equal(state["rank1"], torch.ones(3))
    md = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    assert len(md.state_dict_metadata["model.d"].chunks) == 2  # one per rank
    assert len(md.state_dict_metadata["model.w"].chunks) == 1  # deduplicated


def test_the_writers_results_are_dcps_and_cost_the_collector_no_more() -> None:
    """`shard_writer.write_results` sets the attributes DCP's constructors set (same equality
    and pickle), and, like the plan's byte items, makes no more objects for the
    collector than those constructors (no attribute dict per object)."""
    import gc

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    from trainckpt.format import shard_writer

    assert shard_writer._SAME_FIELDS and plan_cache._SAME_FIELDS  # the direct paths are tested
    state = {f"v{i}": float(i) for i in range(500)}
    items = plan_cache.local_save_plan(state, {}).items
    spans = [(i * 10, 10 + i % 3) for i in range(len(items))]
    ours = shard_writer.write_results(items, "__0_0.distcp", spans)
    theirs = [
        WriteResult(item.index, n, _StorageInfo("__0_0.distcp", offset, n))
        for item, (offset, n) in zip(items, spans, strict=True)
    ]
    assert ours == theirs
    assert pickle.dumps(ours) == pickle.dumps(theirs)

    def tracked(make: Any) -> int:
        gc.collect()
        before = len(gc.get_objects())
        kept = make()
        count = len(gc.get_objects()) - before
        del kept
        return count

    assert tracked(lambda: shard_writer.write_results(items, "f", spans)) <= tracked(
        lambda: [
            WriteResult(item.index, n, _StorageInfo("f", offset, n))
            for item, (offset, n) in zip(items, spans, strict=True)
        ]
    )
    assert tracked(lambda: plan_cache.local_save_plan(state, {})) <= tracked(
        lambda: create_default_local_save_plan(state, True)
    )
