"""The bound on DCP's `.metadata` grows with the folder's shard files (records.py): a large
job's metadata is read, a metadata out of proportion to its shards is refused unread. The
floor is lowered here so that the files stay small (sparse)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainckpt import CorruptCheckpointError
from trainckpt.format import dcp_metadata, records
from trainckpt.storage import resolve

pytestmark = pytest.mark.usefixtures("record_steps")  # C and Python steps alike (conftest)

FLOOR = 1 << 20


@pytest.fixture
def small_floor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(records, "DCP_METADATA_FLOOR_BYTES", FLOOR)
    monkeypatch.setattr(dcp_metadata, "DCP_METADATA_FLOOR_BYTES", FLOOR)


def _folder(tmp_path: Path, metadata_bytes: int, shard_bytes: int) -> Path:
    folder = tmp_path / "model_and_optim"
    folder.mkdir()
    with open(folder / ".metadata", "wb") as f:
        f.truncate(metadata_bytes)  # zeros: not DCP's pickle, refused once read
    with open(folder / "__0_0.distcp", "wb") as f:
        f.truncate(shard_bytes)
    return folder


@pytest.mark.usefixtures("small_floor")
def test_a_metadata_past_the_floor_is_read_when_the_shards_are_large_enough(
    tmp_path: Path,
) -> None:
    folder = _folder(tmp_path, metadata_bytes=3 * FLOOR, shard_bytes=FLOOR)  # bound: 5x floor
    storage, path = resolve(str(folder))
    with pytest.raises(CorruptCheckpointError, match="cannot be read as DCP metadata"):
        dcp_metadata.read_dcp_metadata(storage, path)  # read (and found not to be DCP's)


@pytest.mark.usefixtures("small_floor")
def test_a_metadata_out_of_proportion_to_its_shards_is_refused_unread(tmp_path: Path) -> None:
    folder = _folder(tmp_path, metadata_bytes=3 * FLOOR, shard_bytes=FLOOR // 4)  # bound: 2x
    storage, path = resolve(str(folder))
    with pytest.raises(CorruptCheckpointError, match=f"larger than {2 * FLOOR} bytes"):
        dcp_metadata.read_dcp_metadata(storage, path)


def test_the_bound_grows_with_the_shards() -> None:
    floor = records.DCP_METADATA_FLOOR_BYTES
    assert records.dcp_metadata_bound(0) == floor
    assert records.dcp_metadata_bound(10 * floor) == 41 * floor
