"""The per-item load path at scale (issue #25): the one-pass flattening of the state, plain
values handed to the planner as bytes and parsed once per distinct value, CRC32C checked inline
per item, and the native metadata's records checked column by column. Each keeps the promise
of the slower path it replaces; these tests try to break that."""

from __future__ import annotations

import copy
import dataclasses
import gc
import io
import json
import math
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import Metadata

from trainckpt.core.dcp import (
    _flat_paths,
    _flat_plain,
    _SafeLoadPlanner,
    load_state,
    save_state,
)
from trainckpt.errors import CorruptCheckpointError
from trainckpt.format import native_metadata
from trainckpt.format.dcp_metadata import read_dcp_metadata
from trainckpt.storage.local import LocalStorage


def _nested_state() -> dict[str, Any]:
    """Plain values shaped like a flattened AdamW's: mostly equal, a few not."""
    groups: dict[str, Any] = {}
    for i in range(120):
        groups[f"p{i}.lr"] = 0.001
        groups[f"p{i}.betas"] = (0.9, 0.999)
        groups[f"p{i}.amsgrad"] = False
        groups[f"p{i}.eps"] = 1e-8
    groups["p7.lr"] = 0.002  # one of 120 differs
    groups["p8.betas"] = (0.9, 0.998)
    groups["p9.eps"] = -0.0  # equal to 0.0 in Python, other bytes on disk
    groups["p10.eps"] = 0.0
    groups["p11.amsgrad"] = True
    return {
        "model": {f"w{i}": torch.full((3,), float(i)) for i in range(40)},
        "optim": {"param_groups": groups, "step": 3},
    }


def _blank(state: Any) -> Any:
    if isinstance(state, dict):
        return {k: _blank(v) for k, v in state.items()}
    return torch.zeros_like(state) if isinstance(state, torch.Tensor) else None


def _save_load(tmp_path: Path, state: dict[str, Any]) -> dict[str, Any]:
    folder = tmp_path / "dcp"
    if not folder.exists():
        save_state(state, folder, group=None, thread_count=1)
    storage = LocalStorage()
    md = read_dcp_metadata(storage, str(folder))
    out = _blank(state)
    load_state(out, storage, str(folder), md, group=None, thread_count=1)
    return out  # type: ignore[no-any-return]


def _same(a: Any, b: Any) -> bool:
    """Equal down to the bits: -0.0 is not 0.0, a tuple is not a list."""
    if isinstance(a, dict):
        return type(b) is dict and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, float):
        return type(b) is float and math.copysign(1, a) == math.copysign(1, b) and a == b
    if isinstance(a, tuple):
        return type(b) is tuple and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


def test_each_plain_value_loads_as_its_own_even_among_many_equal_ones(tmp_path: Path) -> None:
    state = _nested_state()
    out = _save_load(tmp_path, state)
    assert _same(out, state)
    groups = out["optim"]["param_groups"]
    assert groups["p7.lr"] == 0.002 and groups["p6.lr"] == 0.001
    assert groups["p8.betas"] == (0.9, 0.998) and groups["p12.betas"] == (0.9, 0.999)
    assert math.copysign(1, groups["p9.eps"]) == -1 and math.copysign(1, groups["p10.eps"]) == 1


def test_a_flipped_byte_in_one_of_many_equal_plain_values_is_caught_and_named(
    tmp_path: Path,
) -> None:
    """The values around it (read in the same read, with the same bytes before the damage) are
    fine; the damaged one is refused by its own CRC32C, not passed over as a value seen before.
    Equal values share one place in the file (`shard_writer._SmallItems`): the damage is
    named at the first item that reads that place."""
    state = _nested_state()
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    md = read_dcp_metadata(LocalStorage(), str(tmp_path / "dcp"))
    [info] = [s for i, s in md.storage_data.items() if i.fqn == "optim.param_groups.p57.lr"]
    sharing = {i.fqn for i, s in md.storage_data.items() if s == info}
    assert {"optim.param_groups.p57.lr", "optim.param_groups.p6.lr"} <= sharing
    assert "optim.param_groups.p7.lr" not in sharing  # 0.002: bytes of its own
    shard = tmp_path / "dcp" / info.relative_path
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError) as caught:
        _save_load(tmp_path, state)
    assert any(f"item '{fqn}'" in str(caught.value) for fqn in sharing), caught.value
    assert info.relative_path in str(caught.value) and "CRC32C" in str(caught.value)


def test_a_plain_value_item_moved_onto_another_of_other_bytes_is_refused(tmp_path: Path) -> None:
    """An item whose bytes are replaced by those of another value of the same length (a valid
    plain value, so it would parse): the CRC32C recorded for that place refuses it."""
    state = _nested_state()
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    md = read_dcp_metadata(LocalStorage(), str(tmp_path / "dcp"))
    places = {i.fqn: s for i, s in md.storage_data.items()}
    src, dst = places["optim.param_groups.p7.lr"], places["optim.param_groups.p6.lr"]
    assert src.length == dst.length and src.relative_path == dst.relative_path
    shard = tmp_path / "dcp" / src.relative_path
    data = bytearray(shard.read_bytes())
    data[dst.offset : dst.offset + dst.length] = data[src.offset : src.offset + src.length]
    shard.write_bytes(bytes(data))
    sharing = {i.fqn for i, s in md.storage_data.items() if s == dst}  # equal values share
    with pytest.raises(CorruptCheckpointError, match="is corrupt") as caught:
        _save_load(tmp_path, state)
    assert any(f"item '{fqn}'" in str(caught.value) for fqn in sharing), caught.value


# -- the one-pass flattening ----------------------------------------------------------------


def test_the_flat_state_and_mappings_are_dcps() -> None:
    state = _nested_state()
    state["top"] = torch.nn.Parameter(torch.ones(2))
    state["empty"] = {}
    state["more"] = {"t": (1, torch.zeros(1)), "n": None, "s": "x", "b": b"y", "c": 1j}
    flat = _flat_plain(state)
    assert flat is not None
    expected, mappings = flatten_state_dict(state)
    assert list(flat[0]) == list(expected) and all(flat[0][k] is expected[k] for k in expected)
    assert _flat_paths(flat[0], flat[1]) == mappings
    for fqn, (parent, key) in flat[2].items():
        assert parent[key] is expected[fqn]


@pytest.mark.parametrize(
    "odd",
    [
        {"a": [1, 2]},  # DCP decides whether a list is a leaf
        {"a": {1: 0.5}},  # DCP turns keys into strings
        {"a.b": 1, "a": {"b": 2}},  # two paths, one flat key: DCP raises
        {"t": torch.empty(2, device="meta")},  # DCP allocates it
        {"o": object()},
        {"m": torch.nn.ParameterDict()},  # a Mapping that is not a dict
    ],
)
def test_anything_else_is_left_to_dcp(odd: dict[str, Any]) -> None:
    assert _flat_plain(odd) is None


def test_the_flattening_leaves_no_garbage_for_the_collector() -> None:
    """Everything the walk builds is freed by reference counting once the planner drops it: a
    recursive closure made every path and slot cyclic garbage, which the collector then
    walked (a fifth of a 16,000-entry load). Nesting deeper than the walk follows goes to
    DCP."""
    state = _nested_state()
    gc.collect()
    gc.disable()
    try:
        flat = _flat_plain(state)
        assert flat is not None and len(flat[0]) > 500
        del flat
        assert gc.collect() == 0
    finally:
        gc.enable()
    deep: dict[str, Any] = {"x": 1}
    for _ in range(1000):
        deep = {"d": deep}
    assert _flat_plain(deep) is None
    nested = {"a": {"b": {"c": 1}, "d": 2}, "e": {"f": {}}, "g": 3}
    flat = _flat_plain(nested)
    assert flat is not None and _flat_paths(*flat[:2]) == flatten_state_dict(nested)[1]


def test_the_planners_mappings_are_dcps_made_on_first_use() -> None:
    """The planner makes DCP's mappings (flat key -> path) only when something reads them: a
    whole plain state is loaded through its slots. Made, they are DCP's, also where a dict's
    values come before and after a nested dict (two runs of one dict)."""
    state: dict[str, Any] = {
        "a": 1,
        "b": {"c": torch.zeros(1), "d": {"e": 2.0}, "f": "x", "g.h": None},
        "i": {"j": {}, "k": 3},
        "l": (4, 5),
    }
    planner = _SafeLoadPlanner(direct=True)
    planner.set_up_planner(state)
    assert planner._mappings is None  # not made yet
    assert planner.mappings == flatten_state_dict(state)[1]
    saved = io.BytesIO()
    torch.save("y", saved)
    planner.load_plain_values([(["b.f"], saved.getvalue())])
    assert state["b"]["f"] == "y"
    other = _SafeLoadPlanner()
    other.mappings = {"x": ("x",)}  # DCP sets them, e.g. for a checkpoint of PyTorch 2.3
    assert other.mappings == {"x": ("x",)}


def test_a_state_that_leaves_out_saved_keys_is_planned_in_one_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys the checkpoint holds and the state lacks are not loaded, as in DCP, without
    DCP's planning: `ModelAndOptim` leaves out the hyperparameters loading does not read."""
    state = _nested_state()
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    storage = LocalStorage()
    md = read_dcp_metadata(storage, str(tmp_path / "dcp"))
    part = _blank(state)
    del part["optim"]["param_groups"]
    part["model"] = {k: part["model"][k] for k in ("w3", "w5")}
    slow: list[str] = []
    dcp_plan = _SafeLoadPlanner.__mro__[1].create_local_plan
    monkeypatch.setattr(
        _SafeLoadPlanner.__mro__[1],
        "create_local_plan",
        lambda self: slow.append("dcp") or dcp_plan(self),
    )
    load_state(part, storage, str(tmp_path / "dcp"), md, group=None, thread_count=1)
    assert slow == []
    assert _same(
        part,
        {"model": {"w3": state["model"]["w3"], "w5": state["model"]["w5"]}, "optim": {"step": 3}},
    )


def test_a_checkpoint_of_pytorch_2_3_still_loads_as_dcp_loads_it(tmp_path: Path) -> None:
    """PyTorch 2.3 saved a dict without tensors whole, under the dict's path. A state whose
    dict has such a path goes to DCP's planning, which flattens the state as 2.3 did."""
    from torch.distributed.checkpoint import _version

    state = {"model": {"w": torch.arange(3.0)}, "extra": {"a": 1, "b": (2, "x")}}
    _version._derived_version = "2_3"
    try:
        save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    finally:
        _version._derived_version = None
    storage = LocalStorage()
    md = read_dcp_metadata(storage, str(tmp_path / "dcp"))
    assert set(md.state_dict_metadata) == {"model.w", "extra"}
    out = _blank(state)
    load_state(out, storage, str(tmp_path / "dcp"), md, group=None, thread_count=1)
    assert _same(out, state)


def _saved(value: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_values_at_one_place_are_parsed_once_and_a_mutable_one_for_each_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The reader hands on the byte values stored at one place together: an immutable value is
    parsed once and shared by every key; a mutable one is parsed for each key, so that no two
    keys share a list."""
    state: dict[str, Any] = {"a": None, "b": None, "c": None, "d": None, "e": None}
    planner = _SafeLoadPlanner(direct=True)
    planner.set_up_planner(state)
    parsed: list[str] = []
    parse = planner._parse
    monkeypatch.setattr(planner, "_parse", lambda fqn, data: parsed.append(fqn) or parse(fqn, data))
    planner.load_plain_values([(["a", "b"], _saved((1, 2.5))), (["c", "d"], _saved([1]))])
    planner.load_plain_values([(["e"], _saved((1, 2.5)))])
    assert state["a"] == (1, 2.5) and state["a"] is state["b"] is state["e"]
    assert state["c"] == state["d"] == [1] and state["c"] is not state["d"]
    assert parsed == ["a", "c", "d"]


def test_two_paths_to_one_key_still_fail_as_in_dcp() -> None:
    planner = _SafeLoadPlanner()
    with pytest.raises(ValueError, match="duplicated flatten key"):
        planner.set_up_planner({"a.b": 1, "a": {"b": 2}})


# -- the native metadata's columns --------------------------------------------------------------


_PLANNER = {"w": ["w"], "v": ["v"]}


def _record(header: dict[str, Any], ints: list[int], planner: Any = _PLANNER) -> bytes:
    """A record of `header` and the chunk table `ints`; from version 2 on, `planner` after the
    table (a dict: as its keys and paths; bytes as they are; else as JSON; None: no section),
    its length in the header unless the header has one."""
    section = b""
    if header["version"] != 1:
        if isinstance(planner, dict):
            planner = [list(planner), list(planner.values())]
        if planner is not None:
            section = planner if isinstance(planner, bytes) else json.dumps(planner).encode()
        header = {"planner": None if planner is None else len(section)} | header
    head = json.dumps(header).encode()
    table = b"".join(v.to_bytes(8, "little", signed=True) for v in ints)
    return native_metadata.MAGIC + len(head).to_bytes(8, "little") + head + table + section


def _header(**changes: Any) -> dict[str, Any]:
    h: dict[str, Any] = {
        "version": 2,
        "dcp_version": "1.0.0",
        "storage_meta": None,
        "files": ["__0_0.distcp"],
        "tensors": [["w", "float32", False, False, [4], 1]],
        "bytes": [["v", 0, 0, 100, 20]],
        "ints": 6,
    }
    return h | changes


_INTS = [0, 4, 1, 0, 0, 100]


def test_the_columns_build_what_the_records_do(tmp_path: Path) -> None:
    """On a real record, the column checks accept it and build the very `Metadata` that the
    record-by-record checks build; its planner data is DCP's own (in `.metadata`)."""
    state = _nested_state()
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    data = (tmp_path / "dcp" / ".metadata.trainckpt").read_bytes()
    fast = native_metadata.decode(data, "rec")
    slow = native_metadata._Decoder(data, "rec")
    header = json.loads(data[16 : 16 + int.from_bytes(data[8:16], "little")])
    entries: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    table = _table(data)[: header["ints"]]  # the planner section follows it
    slow.tensors(header["tensors"], table, header["files"], entries, storage)
    slow.byte_values(header["bytes"], header["files"], entries, storage)
    assert fast.state_dict_metadata == entries and fast.storage_data == storage
    assert list(fast.state_dict_metadata) == list(entries)
    with open(tmp_path / "dcp" / ".metadata", "rb") as f:
        dcp_own = pickle.load(f)  # written by this test
    assert fast.planner_data == dcp_own.planner_data and fast.planner_data
    assert fast == dcp_own


def test_the_storage_keys_are_built_when_first_read_and_copies_share_them(
    tmp_path: Path,
) -> None:
    """`storage_data` of trainckpt's own record is built on first use, the same in every
    copy; the pieces by name are the storage of the single-piece entries; a pickle of it
    (or `dataclasses.replace`) is a plain, equal `Metadata`."""
    state = _nested_state()
    save_state(state, tmp_path / "dcp", group=None, thread_count=1)
    data = (tmp_path / "dcp" / ".metadata.trainckpt").read_bytes()
    md = native_metadata.decode(data, "rec")
    assert isinstance(md, native_metadata.NativeMetadata) and not md.storage_built
    twin = copy.copy(md)
    assert md.pieces is not None
    assert md.pieces == {key.fqn: info for key, info in md.storage_data.items()}
    assert md.storage_built and twin.storage_built and twin.storage_data is md.storage_data
    again = pickle.loads(pickle.dumps(md))
    assert type(again) is Metadata and again == md and md == again
    assert dataclasses.replace(md) == md
    twin.storage_data = {}  # a copy's own value, not its twin's
    assert md.storage_data and not twin.storage_data


def test_the_planner_data_is_parsed_and_checked_when_first_read() -> None:
    """`planner_data` (its own section, version 2) is not parsed by `decode`: it is parsed,
    checked (CRAFTED_PLANNER) and built on first use, the same in every copy; a null one is
    None at once."""
    planner = {"w": ["model", "w"], "v": ["optim", 0, "v"]}
    md = native_metadata.decode(_record(_header(), _INTS, planner), "rec")
    assert isinstance(md, native_metadata.NativeMetadata) and not md.planner_built
    twin = copy.copy(md)
    assert md.planner_data == {"w": ("model", "w"), "v": ("optim", 0, "v")}
    assert md.planner_built and twin.planner_built and twin.planner_data is md.planner_data
    assert pickle.loads(pickle.dumps(md)).planner_data == md.planner_data
    twin.planner_data = {}  # a copy's own value, not its twin's
    assert md.planner_data and twin.planner_data == {}
    empty = native_metadata.decode(_record(_header(), _INTS, None), "rec")
    assert isinstance(empty, native_metadata.NativeMetadata) and empty.planner_built
    assert empty.planner_data is None
    assert native_metadata.decode(_record(_header(), _INTS, {}), "rec").planner_data == {}


@pytest.mark.parametrize("planner", [None, {}, {"w": ("model", "w"), "v": ("optim", 0, "v")}])
def test_the_planner_data_round_trips(planner: Any) -> None:
    """Written as its own section (or none, for None) and read back equal, as a tuple per
    key; a path of other types leaves the metadata to `.metadata` (`encode` says None)."""
    decoded = native_metadata.decode(_record(_header(), _INTS), "rec")
    md = Metadata(decoded.state_dict_metadata, storage_data=dict(decoded.storage_data))
    again = native_metadata.decode(
        native_metadata.encode(dataclasses.replace(md, planner_data=planner)) or b"", "rec"
    )
    assert again.planner_data == planner and again.state_dict_metadata == md.state_dict_metadata
    for bad in ({"w": ["model", "w"]}, {"w": ("model", True)}, {"w": ("model", 1.5)}, {1: ("w",)}):
        assert native_metadata.encode(dataclasses.replace(md, planner_data=bad)) is None


def test_a_version_1_record_is_still_read_its_planner_data_checked_when_decoded() -> None:
    """Records of trainckpt before version 2 have the planner data in the header (a list of
    [key, path]) and no section after the table: still read, checked when decoded."""
    v1 = _header(version=1, planner_data=[["w", ["model", "w"]], ["v", ["optim", 0, "v"]]])
    md = native_metadata.decode(_record(v1, _INTS), "rec")
    assert md.planner_data == {"w": ("model", "w"), "v": ("optim", 0, "v")}
    v2 = native_metadata.decode(_record(_header(), _INTS), "r")
    assert md.state_dict_metadata == v2.state_dict_metadata
    assert (
        native_metadata.decode(_record(v1 | {"planner_data": None}, _INTS), "r").planner_data
        is None
    )
    for bad in ([["w", [1.5]]], [["w", [True]]]):
        with pytest.raises(CorruptCheckpointError, match="'rec'.*planner_data"):
            native_metadata.decode(_record(v1 | {"planner_data": bad}, _INTS), "rec")
    # the fields of one version only
    with pytest.raises(CorruptCheckpointError, match="'rec'.*exactly the fields"):
        native_metadata.decode(_record(v1 | {"version": 2}, _INTS, None), "rec")


def _table(data: bytes) -> list[int]:
    start = 16 + int.from_bytes(data[8:16], "little")
    return [int.from_bytes(data[i : i + 8], "little") for i in range(start, len(data), 8)]


CRAFTED: dict[str, tuple[dict[str, Any], list[int], str]] = {
    "a bool as a bytes hint": (_header(bytes=[["v", True, 0, 100, 20]]), _INTS, "place"),
    "a float as an offset": (_header(bytes=[["v", 0, 0, 1.5, 20]]), _INTS, "place"),
    "a bytes file not listed": (_header(bytes=[["v", 0, 1, 100, 20]]), _INTS, "place"),
    "a negative length": (_header(bytes=[["v", 0, 0, 100, -1]]), _INTS, "place"),
    "a bytes record of 4": (_header(bytes=[["v", 0, 0, 100]]), _INTS, "5 fields"),
    "a bytes name of a tensor": (_header(bytes=[["w", 0, 0, 100, 20]]), _INTS, "bytes name"),
    "a name twice": (
        _header(bytes=[["v", 0, 0, 100, 20], ["v", 0, 0, 120, 20]]),
        _INTS,
        "bytes name",
    ),
    "a list in a size": (
        _header(tensors=[["w", "float32", False, False, [[4]], 1]]),
        _INTS,
        "size",
    ),
    "a bool in a size": (
        _header(tensors=[["w", "float32", False, False, [True], 1]]),
        _INTS,
        "size",
    ),
    "a dtype that is a list": (
        _header(tensors=[["w", ["float32"], False, False, [4], 1]]),
        _INTS,
        "dtype",
    ),
    "a chunk count as text": (
        _header(tensors=[["w", "float32", False, False, [4], "1"]]),
        _INTS,
        "chunks",
    ),
    "a chunk's file not listed": (_header(), [0, 4, 1, 1, 0, 100], "not listed"),
    "a planner length past the file": (_header(planner=10**6), _INTS, "'ints'"),
    "a planner length short of the file": (_header(planner=3), _INTS, "'ints'"),
    "a planner length that is text": (_header(planner="25"), _INTS, "'planner'"),
    "a negative planner length": (_header(planner=-1), _INTS, "'planner'"),
}

CRAFTED_PLANNER: dict[str, tuple[Any, str]] = {
    "a path with a float": ({"w": [1.5]}, r"planner path of 'w'"),
    "a path with a bool": ({"w": ["a"], "v": [True]}, r"planner path of 'v'"),
    "a path with an object": ({"w": [{"__reduce__": "os.system"}]}, "planner path of 'w'"),
    "a path with a list": ({"w": [["w"]]}, "planner path of 'w'"),
    "a path that is text": ({"w": "w"}, "planner path of 'w'"),
    "a path that is null": ({"w": None}, "planner path of 'w'"),
    "a list of pairs (version 1)": ([["w", ["w"]]], "not two lists"),
    "an object": (b'{"w": ["w"]}', "not two lists"),
    "more keys than paths": ([["w", "v"], [["w"]]], "not two lists"),
    "a key that is a number": ([[1], [["w"]]], "planner key"),
    "a key twice": ([["w", "w"], [["w"], ["v"]]], "twice"),
    "not JSON": (b'{"w": ["w"]', "not JSON"),
    "not UTF-8": (b'{"w": ["\xff"]}', "not JSON"),
    "too many containers": (b"[" * 64 + b"]" * 64, "lists and objects"),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_a_crafted_column_is_refused_and_named(name: str) -> None:
    header, ints, why = CRAFTED[name]
    with pytest.raises(CorruptCheckpointError, match=f"'rec'.*{why}"):
        native_metadata.decode(_record(header, ints), "rec")


@pytest.mark.parametrize("name", sorted(CRAFTED_PLANNER))
def test_a_crafted_planner_section_is_refused_and_named_when_read(name: str) -> None:
    """The section is parsed only when `planner_data` is read: a load that never reads it
    decodes the record (the manifest's CRC32C of the whole file vouches for its bytes,
    `docs/scale.md`); the first read refuses it, naming the file, and so does every later
    one (nothing half-built is kept)."""
    planner, why = CRAFTED_PLANNER[name]
    md = native_metadata.decode(_record(_header(), _INTS, planner), "rec")
    assert set(md.state_dict_metadata) == {"w", "v"}
    for _ in range(2):
        with pytest.raises(CorruptCheckpointError, match=f"'rec'.*{why}"):
            md.planner_data  # noqa: B018
    with pytest.raises(CorruptCheckpointError, match="'rec'"):
        pickle.dumps(md)  # pickling reads it too


def test_a_good_small_record_is_read_by_the_columns() -> None:
    md = native_metadata.decode(_record(_header(), _INTS), "rec")
    assert set(md.state_dict_metadata) == {"w", "v"}
    assert md.planner_data == {"w": ("w",), "v": ("v",)}


def test_equal_mutable_values_load_as_separate_objects(tmp_path: Path) -> None:
    """Items with equal bytes are checked by comparison and handed on as one bytes object,
    but a mutable value parsed from them is parsed per item: changing one loaded list
    changes no other."""
    state: dict[str, Any] = {f"v{i}": [1, 2, 3] for i in range(6)}  # a list of ints: one item
    state["t"] = torch.ones(3)
    out = _save_load(tmp_path, state)
    assert all(out[f"v{i}"] == [1, 2, 3] for i in range(6)) and torch.equal(out["t"], state["t"])
    out["v0"].append(9)
    out["v1"][0] = 7
    assert all(out[f"v{i}"] == [1, 2, 3] for i in range(2, 6))
    assert len({id(out[f"v{i}"]) for i in range(6)}) == 6


def test_equal_values_past_a_short_read_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Equal byte values are compared in the reading thread's buffer, which is reused from
    span to span: a read that returns less than asked (a file changed while read) must not
    let the bytes an earlier span left in the buffer pass for the missing items. Two files
    (two writer threads), each holding the equal value once, read by one thread."""
    from trainckpt.format import shard_reader

    state: dict[str, Any] = {"optim": {"param_groups": {f"p{i}.lr": 0.001 for i in range(60)}}}
    save_state(state, tmp_path / "dcp", group=None, thread_count=2)
    md = read_dcp_metadata(LocalStorage(), str(tmp_path / "dcp"))
    assert len({s.relative_path for s in md.storage_data.values()}) == 2
    places = {(s.relative_path, s.offset, s.length) for s in md.storage_data.values()}
    assert len(places) == 2  # one place per file
    monkeypatch.setattr(shard_reader.ParallelReader, "thread_count", 1, raising=False)
    real = shard_reader._ItemBuffer.read
    reads: list[int] = []

    def second_read_short(buffer: Any, file_slice: Any, n: int) -> Any:
        got = real(buffer, file_slice, n)
        reads.append(n)
        if len(reads) == 2:  # the first span's bytes are still in the buffer past this one
            buffer._lent = got[: len(got) // 2]
            return buffer._lent
        return got

    monkeypatch.setattr(shard_reader._ItemBuffer, "read", second_read_short)
    with pytest.raises(CorruptCheckpointError, match=r"item 'optim\.param_groups\.p\d+\.lr'"):
        _save_load(tmp_path, state)
    assert len(reads) == 2 and reads[0] == reads[1]
