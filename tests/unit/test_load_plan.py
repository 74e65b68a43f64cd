"""The load planner: DCP's local plan, with values that need no resharding planned directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, default_planner, planner_helpers
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from trainckpt.core.dcp import _SafeLoadPlanner, save_state


def _saved(size: tuple[int, ...], *chunks: tuple[tuple[int, ...], tuple[int, ...]]) -> Any:
    if not chunks:
        chunks = ((tuple(0 for _ in size), size),)
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


def _metadata() -> Metadata:
    return Metadata(
        state_dict_metadata={
            "whole": _saved((4, 3)),
            "param": _saved((5,)),
            "scalar": _saved(()),
            "empty": _saved((0, 4)),
            "two_chunks": _saved((4, 3), ((0, 0), (2, 3)), ((2, 0), (2, 3))),
            "offset": _saved((2, 3), ((1, 0), (2, 3))),  # a chunk not at the origin
            "nested.n": BytesStorageMetadata(),
            "nested.list": BytesStorageMetadata(),
            "as_bytes": BytesStorageMetadata(),
        },
        planner_data={
            "nested.n": ("nested", "n"),
            "nested.list": ("nested", "list"),
        },
    )


def _state() -> dict[str, Any]:
    return {
        "whole": torch.zeros(4, 3),
        "param": torch.nn.Parameter(torch.zeros(5)),
        "scalar": torch.tensor(0.0),
        "empty": torch.zeros(0, 4),
        "two_chunks": torch.zeros(4, 3),
        "offset": torch.zeros(2, 3),
        "nested": {"n": 0, "list": [0]},
        "as_bytes": torch.zeros(2),
    }


def _plan(planner: DefaultLoadPlanner, state: dict[str, Any]) -> list[Any]:
    planner.set_up_planner(state, _metadata())
    return planner.create_local_plan().items


def test_the_plan_is_dcps_and_only_resharded_values_take_dcps_general_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same read items, in the same order, as DCP's own planner; DCP's overlap search runs
    only for the values that need it, and the state is not copied to flatten sharded
    tensors it does not hold."""
    expected = _plan(DefaultLoadPlanner(), _state())
    searched: list[str] = []
    copied: list[object] = []
    real_search = planner_helpers.create_read_items_for_chunk_list
    real_copy = default_planner._flatten_sharded_tensors

    def search(fqn: str, *args: Any) -> Any:
        searched.append(fqn)
        return real_search(fqn, *args)

    def copy(state: Any) -> Any:
        copied.append(state)
        return real_copy(state)

    monkeypatch.setattr(planner_helpers, "create_read_items_for_chunk_list", search)
    monkeypatch.setattr(default_planner, "_flatten_sharded_tensors", copy)
    ours = _plan(_SafeLoadPlanner(), _state())
    assert ours == expected
    assert [(i.dest_index.index, i.storage_index.index) for i in ours] == [
        (i.dest_index.index, i.storage_index.index) for i in expected
    ]
    assert sorted(searched) == ["empty", "offset", "two_chunks"]
    assert copied == []


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.pop("whole"),  # a partial load: DCP's path for older checkpoints' keys
        lambda s: s.update(extra=torch.zeros(1)),  # not in the checkpoint: DCP's error
        lambda s: s.update(whole=torch.zeros(3, 4)),  # another shape: DCP's error
    ],
)
def test_other_states_are_planned_or_refused_as_dcp_does(change: Any) -> None:
    outcomes = []
    for planner in (DefaultLoadPlanner(), _SafeLoadPlanner()):
        state = _state()
        change(state)
        try:
            outcomes.append(_plan(planner, state))
        except Exception as e:  # noqa: BLE001 - the same error either way
            outcomes.append(f"{type(e).__name__}: {e}")
    assert outcomes[0] == outcomes[1]


def test_nested_values_load_where_they_were(tmp_path: Path) -> None:
    """Values at every depth (dicts, lists, tensors beside plain values) land in their place,
    through the planned read items and the direct placement of plain values."""
    state: dict[str, Any] = {
        "top": 3,
        "a": {"b": {"c": 1.5, "t": torch.arange(6.0)}, "lst": [1, torch.ones(2), {"d": "x"}]},
        "opt": {"lr": 0.1, "betas": (0.9, 0.99)},
    }
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    blank: dict[str, Any] = {
        "top": 0,
        "a": {"b": {"c": 0.0, "t": torch.zeros(6)}, "lst": [0, torch.zeros(2), {"d": ""}]},
        "opt": {"lr": 0.0, "betas": (0.0, 0.0)},
    }
    reader = FileSystemReader(str(tmp_path / "dcp"))
    dcp.load(blank, storage_reader=reader, planner=_SafeLoadPlanner(), no_dist=True)
    assert blank["top"] == 3 and blank["opt"] == {"lr": 0.1, "betas": (0.9, 0.99)}
    assert blank["a"]["b"]["c"] == 1.5 and torch.equal(blank["a"]["b"]["t"], torch.arange(6.0))
    assert blank["a"]["lst"][0] == 1 and torch.equal(blank["a"]["lst"][1], torch.ones(2))
    assert blank["a"]["lst"][2] == {"d": "x"}


def test_a_direct_plan_lists_what_dcps_plan_reads_whole() -> None:
    """With `direct`, the values DCP reads whole (byte values, plain tensors in one chunk of
    their size) are listed by name with the tensor to fill, not planned as read items; the
    read items left are DCP's for everything else, and each listed entry's read item is the
    one DCP plans."""
    expected = _plan(DefaultLoadPlanner(), _state())
    planner = _SafeLoadPlanner(direct=True)
    state = _state()
    rest = _plan(planner, state)
    listed = {fqn: target for fqn, target in planner.direct_items}
    assert sorted(listed) == ["as_bytes", "nested.list", "nested.n", "param", "scalar", "whole"]
    assert listed["whole"] is state["whole"] and listed["nested.n"] is None
    assert listed["as_bytes"] is None  # saved as bytes: a byte value, whatever it is now
    assert rest == [i for i in expected if i.dest_index.fqn not in listed]
    by_fqn = {i.dest_index.fqn: i for i in expected}
    for fqn, target in planner.direct_items:
        assert planner.direct_read_item(fqn, target) == by_fqn[fqn]
