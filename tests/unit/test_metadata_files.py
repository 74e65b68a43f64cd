"""A save's `.metadata` and `.metadata.trainckpt` bytes are reused around the new storage meta
only while nothing else they hold changed (format/metadata_files.py): the reused bytes are a
fresh encode's, every reader reads them, and any change of layout means a fresh encode."""

from __future__ import annotations

import dataclasses
import io
import pickle
import pickletools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from trainckpt.format import metadata_files, native_metadata
from trainckpt.format.safe_unpickle import load_dcp_metadata


def _metadata(tensors: int = 6) -> Metadata:
    entries: dict[str, Any] = {"step": BytesStorageMetadata()}
    for t in range(tensors):
        entries[f"w{t}"] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32),
            torch.Size([4, 2]),
            [ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 2]))],
        )
    return Metadata(entries, planner_data={k: ("model", k) for k in entries})


def _results(md: Metadata, step_length: int = 700, file: str = "__0_0.distcp") -> list[Any]:
    """One rank's write results: the byte item first, then every tensor, one after another."""
    out = [WriteResult(MetadataIndex("step"), step_length, _StorageInfo(file, 0, step_length))]
    offset = step_length
    for fqn in list(md.state_dict_metadata)[1:]:
        index = MetadataIndex(fqn, torch.Size([0, 0]), 0)
        out.append(WriteResult(index, 900, _StorageInfo(file, offset, 900)))
        offset += 900
    return [out]


def _meta(save_id: str, folder: str) -> StorageMeta:
    return StorageMeta(checkpoint_id=Path(folder), save_id=save_id)


def _encode(md: Metadata, results: list[Any], meta: StorageMeta) -> tuple[str, Any]:
    """Encode; return whether the bytes were "encoded" or "reused", and the bytes."""
    before = dict(metadata_files.counts)
    files = metadata_files.encode(md, results, meta)
    (what,) = [k for k, v in metadata_files.counts.items() if v != before.get(k, 0)]
    return what, files


def _describe(files: metadata_files.Encoded, md: Metadata) -> None:
    """Both files hold exactly `md`, for every reader (the pickle has no unused opcodes)."""
    assert files.native is not None
    pickletools.dis(files.pickled, out=io.StringIO())  # a well-formed pickle
    for got in (
        pickle.loads(files.pickled),  # plain DCP, OLMo-core, torchtitan
        load_dcp_metadata(files.pickled, "test .metadata"),  # the safe unpickler
        native_metadata.decode(files.native, "test .metadata.trainckpt"),
    ):
        for field in ("state_dict_metadata", "planner_data", "storage_data", "version"):
            assert getattr(got, field) == getattr(md, field), field
        assert got.storage_meta.save_id == md.storage_meta.save_id
        assert str(got.storage_meta.checkpoint_id) == str(md.storage_meta.checkpoint_id)


def test_the_next_save_of_the_same_layout_reuses_the_bytes_of_a_fresh_encode() -> None:
    metadata_files.forget()
    md = _metadata()
    md.version = "1.0.0"
    assert _encode(md, _results(md), _meta("tckpt-a1", "/ck/step1"))[0] == "encoded"
    again = dataclasses.replace(md)  # a reused plan: the same entries object
    meta = _meta("tckpt-b22222", "/ck/a/longer/step2")  # other lengths than the first
    what, reused = _encode(again, _results(md), meta)
    assert what == "reused"
    _describe(reused, again)
    metadata_files.forget()
    fresh = dataclasses.replace(md)
    assert _encode(fresh, _results(md), meta) == ("encoded", reused)


CHANGES: dict[str, Callable[[Metadata], tuple[Metadata, list[Any]]]] = {
    "a byte item's length": lambda md: (dataclasses.replace(md), _results(md, step_length=701)),
    "another file": lambda md: (dataclasses.replace(md), _results(md, file="__0_1.distcp")),
    "a new global plan (world size)": lambda md: (
        dataclasses.replace(md, state_dict_metadata=dict(md.state_dict_metadata)),
        _results(md),
    ),
    "another planner data": lambda md: (
        dataclasses.replace(md, planner_data=dict(md.planner_data)),
        _results(md),
    ),
    "another rank's results": lambda md: (
        dataclasses.replace(md),
        _results(md) + [[WriteResult(MetadataIndex("x"), 1, _StorageInfo("__1_0.distcp", 0, 1))]],
    ),
}


@pytest.mark.parametrize("change", CHANGES)
def test_any_change_of_what_the_files_hold_encodes_them_anew(change: str) -> None:
    metadata_files.forget()
    md = _metadata()
    md.version = "1.0.0"
    _encode(md, _results(md), _meta("tckpt-a1", "/ck/step1"))
    changed, results = CHANGES[change](md)
    what, files = _encode(changed, results, _meta("tckpt-b2", "/ck/step2"))
    assert what == "encoded"
    expected = {r.index: r.storage_data for rs in results for r in rs}
    assert changed.storage_data == expected
    assert pickle.loads(files.pickled).storage_data == expected


def test_frames_are_dropped_and_a_pickle_not_made_of_frames_is_left_whole() -> None:
    data = pickle.dumps(list(range(100_000)), protocol=4)
    flat = metadata_files._unframed(data)
    assert flat is not None and flat[2] != pickle.FRAME[0] and len(flat) < len(data)
    assert pickle.loads(flat) == list(range(100_000))
    big = pickle.dumps(["x" * 200_000, 1], protocol=4)  # written outside of frames
    assert metadata_files._unframed(big) is None


def test_the_very_result_lists_of_the_kept_layout_reuse_it_and_a_longer_one_does_not() -> None:
    """The writer hands out the previous save's result lists when every item kept its place:
    known equal by identity, their bytes are reused; a list that grew since is compared row
    by row (and here differs)."""
    metadata_files.forget()
    md = _metadata()
    md.version = "1.0.0"
    results = _results(md)
    assert _encode(md, results, _meta("tckpt-a1", "/ck/step1"))[0] == "encoded"
    again = dataclasses.replace(md)
    what, reused = _encode(again, results, _meta("tckpt-b2", "/ck/step2"))
    assert what == "reused"
    _describe(reused, again)
    results[0].append(WriteResult(MetadataIndex("x"), 1, _StorageInfo("__0_0.distcp", 9, 1)))
    grown = dataclasses.replace(md)
    assert _encode(grown, results, _meta("tckpt-c3", "/ck/step3"))[0] == "encoded"
    assert MetadataIndex("x") in grown.storage_data
