"""The `.metadata` interpreter reads every real DCP pickle exactly as pickle does, and anything
else ends in a `CheckpointError`: refused records, escaping storage paths, random damage."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import pytest
import torch
from support.hostile import Calls, shell, torch_save_bytes

from trainckpt import CorruptCheckpointError, UnsafeCheckpointError
from trainckpt.errors import CheckpointError
from trainckpt.format.safe_unpickle import load_dcp_metadata, load_torch_plain

pytestmark = pytest.mark.usefixtures("record_steps")  # C and Python steps alike (conftest)


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_real_metadata_in_every_protocol_reads_as_pickle_does(metadata_bytes, protocol):
    md = pickle.loads(metadata_bytes)  # our own file: trusted here
    data = pickle.dumps(md, protocol=protocol)
    assert load_dcp_metadata(data, "md") == md


def test_storage_record_outside_the_folder_is_refused(metadata_bytes):
    md = pickle.loads(metadata_bytes)
    next(iter(md.storage_data.values())).relative_path = "../../elsewhere/x.distcp"
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint folder"):
        load_dcp_metadata(pickle.dumps(md), "md")


def test_record_without_a_required_field_is_refused(metadata_bytes):
    md = pickle.loads(metadata_bytes)
    del md.__dict__["state_dict_metadata"]
    with pytest.raises(UnsafeCheckpointError, match="state_dict_metadata"):
        load_dcp_metadata(pickle.dumps(md), "md")


def test_truncated_metadata_is_corrupt_not_unsafe(metadata_bytes):
    for cut in range(0, len(metadata_bytes), max(1, len(metadata_bytes) // 97)):
        with pytest.raises(CorruptCheckpointError, match="md") as info:
            load_dcp_metadata(metadata_bytes[:cut], "md")
        assert type(info.value) is CorruptCheckpointError


def test_random_damage_ends_in_a_checkpoint_error_or_what_pickle_reads(metadata_bytes):
    """Fuzz: flipped, inserted and deleted bytes (seeded). Every outcome is a CheckpointError
    or a read equal to what pickle itself reads from the same bytes (so the interpreter never
    makes up data). Such a read is not the original data (with this seed, 12 of 400 reads hold
    another value where the damage hit one): the manifest's CRC32C of `.metadata` is what
    refuses them before a load (`check_loaded_file`); a checkpoint without a manifest has no
    such check."""
    original = pickle.loads(metadata_bytes)
    rng = random.Random(13)
    outcomes: dict[str, int] = {}
    for _ in range(400):
        data = bytearray(metadata_bytes)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data))
            kind = rng.choice(["flip", "insert", "delete"])
            if kind == "flip":
                data[i] ^= 1 << rng.randrange(8)
            elif kind == "insert":
                data.insert(i, rng.randrange(256))
            else:
                del data[i]
        try:
            read = load_dcp_metadata(bytes(data), "md")
        except CheckpointError as e:
            outcome = type(e).__name__
        else:
            # Only names the interpreter allowed were built, so pickle may read these bytes.
            assert read == pickle.loads(bytes(data)), f"damaged bytes read differently: {data!r}"
            outcome = "read the original" if read == original else "read another value"
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("UnsafeCheckpointError", 0) + outcomes.get("CorruptCheckpointError", 0)


def test_a_memory_mapped_file_loads_and_is_refused_as_its_bytes_are(tmp_path: Path):
    """`load_torch_plain` of a path (memory-mapped): the same values as from the bytes, a
    hostile file refused with nothing run, a torn one reported as damaged."""
    state = {"w": torch.arange(10_000, dtype=torch.float32), "n": 3, "nested": {"b": [1, 2]}}
    good = tmp_path / "good.pt"
    good.write_bytes(torch_save_bytes(state))
    mapped = load_torch_plain(good, "good")
    assert torch.equal(mapped["w"], state["w"]) and mapped["n"] == 3
    assert mapped["nested"] == {"b": [1, 2]}

    marker = tmp_path / "ran"
    hostile = tmp_path / "hostile.pt"
    hostile.write_bytes(torch_save_bytes({"w": Calls(os.system, shell(marker))}))
    with pytest.raises(UnsafeCheckpointError, match="hostile"):
        load_torch_plain(hostile, "hostile")
    assert not marker.exists()

    torn = tmp_path / "torn.pt"
    torn.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="torn is damaged"):
        load_torch_plain(torn, "torn")


def test_a_value_is_taken_for_a_left_out_field_only_if_it_is_the_marker_itself() -> None:
    """The check reads a field a record left out as a private marker (a bare `object`). No
    allowed global builds a bare `object`, but if a record held one it must be refused as a
    value of the wrong type, not read as the field's default: alone in its column or beside
    records that did leave the field out."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from trainckpt.format.safe_unpickle.dcp_allow_list import allow_list
    from trainckpt.format.safe_unpickle.refusal import Refused

    allowed = allow_list()

    def record(**fields: object) -> object:
        r = object.__new__(_StorageInfo)
        r.__dict__.update(relative_path="__0_0.distcp", offset=0, length=1, **fields)
        return r

    allowed._check(_StorageInfo, [record(), record()])  # left out of both: the default
    for records in ([record(transform_descriptors=object())],
                    [record(), record(transform_descriptors=object())]):  # fmt: skip
        with pytest.raises(Refused, match="transform_descriptors of type"):
            allowed._check(_StorageInfo, records)


def test_records_that_leave_a_defaulted_field_out_in_part_are_checked_column_by_column() -> None:
    """DCP leaves `offset` out of the `MetadataIndex` of every entry that is not a tensor (an
    optimizer's hyperparameters), so a real `.metadata` mixes records with and without it.
    They take the check by columns (`_check_alike`) instead of the one record by record; a
    wrong value where the field is held is still refused, by name."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    from trainckpt.format.safe_unpickle.dcp_allow_list import allow_list
    from trainckpt.format.safe_unpickle.refusal import Refused

    allowed = allow_list()

    def record(**fields: object) -> object:
        r = object.__new__(MetadataIndex)
        r.__dict__.update({"fqn": "optim.param_groups.0.lr", "index": None, **fields})
        return r

    mixed = [record(), record(offset=torch.Size([0, 0]), index=0)]
    assert allowed._check_alike(MetadataIndex, [vars(r) for r in mixed])
    allowed._check(MetadataIndex, mixed)
    assert mixed[0].offset is None  # read as DCP's default: the record is left as it was
    assert "offset" not in vars(mixed[0])
    bad = [record(), record(offset="0,0")]
    assert not allowed._check_alike(MetadataIndex, [vars(r) for r in bad])
    with pytest.raises(Refused, match="MetadataIndex.offset of type"):
        allowed._check(MetadataIndex, bad)
    extra = [record(), record(offset=torch.Size([0]), other=1)]
    assert not allowed._check_alike(MetadataIndex, [vars(r) for r in extra])
    with pytest.raises(Refused, match=r"MetadataIndex with field\(s\) \['other'\]"):
        allowed._check(MetadataIndex, extra)


def test_a_field_an_older_writer_did_not_have_reads_as_its_default(metadata_bytes):
    """An older DCP pickled `_StorageInfo` without `transform_descriptors`, `StorageMeta`
    without `modules`: they read as DCP's defaults; an extra field is refused."""
    md = pickle.loads(metadata_bytes)
    for info in md.storage_data.values():
        info.__dict__.pop("transform_descriptors", None)
    del md.storage_meta.__dict__["modules"]
    read = load_dcp_metadata(pickle.dumps(md), "md")
    assert {i.transform_descriptors for i in read.storage_data.values()} == {None}
    assert read.storage_meta.modules == []
    # Left out of some records only: those read as the default, the others are checked.
    first, second = list(md.storage_data)[:2]
    md.storage_data[first].__dict__["transform_descriptors"] = ["zstd"]
    read = load_dcp_metadata(pickle.dumps(md), "md")
    assert read.storage_data[first].transform_descriptors == ["zstd"]
    assert read.storage_data[second].transform_descriptors is None
    md.storage_data[first].__dict__["transform_descriptors"] = 7
    with pytest.raises(UnsafeCheckpointError, match=r"_StorageInfo.transform_descriptors of type"):
        load_dcp_metadata(pickle.dumps(md), "md")
    del md.storage_data[first].__dict__["transform_descriptors"]
    next(iter(md.storage_data.values())).__dict__["extra"] = 1
    with pytest.raises(UnsafeCheckpointError, match=r"_StorageInfo with field\(s\) \['extra'\]"):
        load_dcp_metadata(pickle.dumps(md), "md")
