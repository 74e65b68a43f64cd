"""Save plans are reused while the state keeps its structure, and planned anew whenever it
changes (core/plan_cache.py): a changed shape, dtype, key set, mesh placement or world size
each re-plan, and what is written is always the state being saved (read back and compared)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.multiproc import run_ranks

from trainckpt.core import plan_cache
from trainckpt.core.dcp import load_full_state, save_state
from trainckpt.errors import CheckpointError
from trainckpt.format import metadata_files
from trainckpt.format.dcp_metadata import read_dcp_metadata
from trainckpt.storage import resolve


def _read(folder: Path) -> dict[str, Any]:
    storage, path = resolve(str(folder))
    return load_full_state(storage, path, read_dcp_metadata(storage, path))


def _save(state: dict[str, Any], folder: Path, group: Any = None) -> dict[str, int]:
    """Save `state`; return what this process planned and reused for it."""
    before = dict(plan_cache.counts)
    save_state(state, folder, group=group, thread_count=2, durable=False)
    return {k: v - before.get(k, 0) for k, v in plan_cache.counts.items() if v != before.get(k)}


REUSED = {"local reused": 1, "global reused": 1}
PLANNED = {"local planned": 1, "global planned": 1}


def _same(written: dict[str, Any], state: dict[str, Any]) -> None:
    assert written.keys() == state.keys()
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            w = written[k]
            assert w.dtype == v.dtype and w.shape == v.shape and torch.equal(w, v), k
        else:
            assert written[k] == v, k


def test_one_rank_reuses_its_plan_and_replans_on_every_change(tmp_path: Path) -> None:
    plan_cache.forget()
    state: dict[str, Any] = {"w": torch.randn(4, 8), "b": torch.randn(8), "step": 3}
    assert _save(state, tmp_path / "s1") == PLANNED
    state["w"] = torch.randn(4, 8)  # new values, same structure
    state["step"] = 4
    assert _save(state, tmp_path / "s2") == REUSED
    _same(_read(tmp_path / "s2"), state)
    changes = {
        "shape": lambda s: s.update(w=torch.randn(5, 8)),
        "dtype": lambda s: s.update(b=s["b"].to(torch.bfloat16)),
        "new key": lambda s: s.update(extra=torch.ones(2)),
        "a key gone": lambda s: s.pop("step"),
        "tensor to value": lambda s: s.update(b=1.5),
        "requires_grad": lambda s: s.update(w=s["w"].clone().requires_grad_()),
    }
    for i, (what, change) in enumerate(changes.items()):
        change(state)
        assert _save(state, tmp_path / f"c{i}") == PLANNED, what
        _same(_read(tmp_path / f"c{i}"), state)
        assert _save(state, tmp_path / f"r{i}") == REUSED, what


def test_a_failed_save_forgets_every_plan(tmp_path: Path) -> None:
    plan_cache.forget()
    state = {"w": torch.randn(3)}
    _save(state, tmp_path / "a")
    (tmp_path / "blocked").write_text("a file where the folder should be")
    with pytest.raises(CheckpointError):
        _save(state, tmp_path / "blocked" / "b")
    assert _save(state, tmp_path / "c") == PLANNED


def _plain_dcp(folder: Path, like: dict[str, Any]) -> dict[str, Any]:
    """`folder` read by plain DCP, which unpickles `.metadata` itself."""
    import torch.distributed.checkpoint as dcp

    state = {
        k: torch.empty_like(v) if isinstance(v, torch.Tensor) else None for k, v in like.items()
    }
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    return state


def test_metadata_files_are_reused_only_while_every_item_keeps_its_place(tmp_path: Path) -> None:
    plan_cache.forget()
    metadata_files.forget()
    state: dict[str, Any] = {"w": torch.randn(4, 8), "step": 3, "name": "a"}

    def save(name: str) -> tuple[dict[str, int], str]:
        before = dict(metadata_files.counts)
        plans = _save(state, tmp_path / name)
        (files,) = [k for k, v in metadata_files.counts.items() if v != before.get(k, 0)]
        _same(_read(tmp_path / name), state)  # every item checked against its CRC32C
        _same(_plain_dcp(tmp_path / name, state), state)
        return plans, files

    assert save("a") == (PLANNED, "encoded")
    state["w"], state["step"] = torch.randn(4, 8), 4
    assert save("b") == (REUSED, "reused")
    state["name"] = "a" * 300  # a byte item of another length: same plan, items moved
    assert save("c") == (REUSED, "encoded")
    state["name"] = "b" * 300  # same length, other bytes: every item stays in place
    assert save("d") == (REUSED, "reused")


def _ranks_body(rank: int, world: int, root: str) -> list[dict[str, int]]:
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    plan_cache.forget()
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(64.0).reshape(8, 8)
    out: list[dict[str, int]] = []

    def save(state: dict[str, Any], name: str, group: Any = None) -> None:
        out.append(_save(state, Path(root) / name, group))
        tdist.barrier()

    state: dict[str, Any] = {"d": distribute_tensor(full, mesh, [Shard(0)]), "r": torch.ones(3)}
    save(state, "a")  # planned
    state["d"] = distribute_tensor(full * 2, mesh, [Shard(0)])
    save(state, "b")  # reused everywhere
    if rank == 1:
        state["only1"] = torch.full((2,), 7.0)  # one rank changes: it alone re-plans locally
    save(state, "c")
    state.pop("only1", None)
    state["d"] = distribute_tensor(full * 3, mesh, [Shard(1)])  # resharded
    save(state, "d")
    state["d"] = distribute_tensor(full * 4, mesh, [Replicate()])
    save(state, "e")
    save({"r": state["r"]}, "e2")
    solo = tdist.new_group([0])  # the same state on another world size
    if rank == 0:
        out.append(_save({"r": state["r"]}, Path(root) / "f", solo))
    tdist.barrier()
    return out


def test_ranks_reuse_the_global_plan_and_replan_on_changes(tmp_path: Path) -> None:
    results = run_ranks(_ranks_body, 2, str(tmp_path))
    coord, other = results
    local_only = {"local planned": 1}
    assert [r.get("local reused", 0) for r in coord[:5]] == [0, 1, 1, 0, 0]
    assert [r.get("local reused", 0) for r in other[:5]] == [0, 1, 0, 0, 0]
    assert other[2] == local_only  # only rank 1 changed; rank 0 sent a token
    assert [r.get("global reused", 0) for r in coord[:5]] == [0, 1, 0, 0, 0]
    assert [r.get("global planned", 0) for r in coord[:5]] == [1, 0, 1, 1, 1]
    assert coord[6] == PLANNED  # world size 1: planned anew, not the 2-rank plan
    full = torch.arange(64.0).reshape(8, 8)
    for name, factor in {"a": 1, "b": 2, "d": 3, "e": 4}.items():
        written = _read(tmp_path / name)
        assert torch.equal(written["d"], full * factor), name
        assert set(written) == {"d", "r"}, name
    written = _read(tmp_path / "c")
    assert torch.equal(written["only1"], torch.full((2,), 7.0))
    assert torch.equal(written["d"], full * 2)
    assert set(_read(tmp_path / "f")) == {"r"}


def test_the_flattening_is_dcps_own_or_left_to_dcp() -> None:
    """`flatten_nested` gives DCP's flat state (same keys, order and values) and mappings, or
    leaves to DCP what it does not flatten the same way."""
    from collections import OrderedDict

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors

    w = torch.randn(2)
    state: dict[str, Any] = {
        "model": OrderedDict([("b.weight", w), ("a", {"x": 1, 3: (w, "t")})]),
        "empty": {},
        "optim": {"state": {"z": {"step": torch.tensor(1.0)}}, "lr": 0.1},
        "top": None,
    }
    flat, mappings = plan_cache.flatten_nested(state)  # type: ignore[misc]
    dcp_flat, dcp_mappings = flatten_state_dict(state)
    dcp_flat = _flatten_sharded_tensors(dcp_flat)
    assert list(flat) == list(dcp_flat) and mappings == dcp_mappings
    assert all(flat[k] is dcp_flat[k] for k in flat)
    for left in ({"a": [w]}, {"a": {"b": 1}, "a.b": 2}, {"a": {"b": [1, 2]}}):
        assert plan_cache.flatten_nested(left) is None


def test_the_same_flat_keys_under_another_nesting_replan(tmp_path: Path) -> None:
    """The state's shape tells nestings apart that flatten to the same keys: DCP's mappings
    (which nested dict each value goes back to on load) differ, so the plan must too."""
    plan_cache.forget()
    w = torch.randn(3)
    one: dict[str, Any] = {"a": {"b.c": w, "n": 1}}
    other: dict[str, Any] = {"a.b": {"c": w}, "a": {"n": 1}}
    assert _save(one, tmp_path / "s1") == PLANNED
    assert _save(other, tmp_path / "s2") == PLANNED
    mappings = read_dcp_metadata(*resolve(str(tmp_path / "s2"))).planner_data
    assert mappings["a.b.c"] == ("a.b", "c")
    assert _save(one, tmp_path / "s3") == REUSED  # the first plan is still kept
    assert read_dcp_metadata(*resolve(str(tmp_path / "s3"))).planner_data["a.b.c"] == (
        "a",
        "b.c",
    )
    _same(_read(tmp_path / "s3"), {"a.b.c": w, "a.n": 1})
