"""One contract for every writable storage back end (`storage/base.py`), run against each.

Adding a back end is one entry in `BACKENDS`: a function that takes pytest's `request` and
returns (a Storage, an empty root folder in that storage's location form).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from trainckpt.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from trainckpt.storage import Storage, StorageOptions, Versioned, resolve
from trainckpt.storage.checksums import crc32c_bytes


def _local(request: pytest.FixtureRequest) -> tuple[Storage, str]:
    tmp: Path = request.getfixturevalue("tmp_path")
    return resolve(str(tmp / "root"))


def _gcs(request: pytest.FixtureRequest) -> tuple[Storage, str]:
    bucket: str = request.getfixturevalue("gcs_bucket")
    return resolve(f"{bucket}/root", StorageOptions(thread_count=4, retry_deadline=20))


def _s3(request: pytest.FixtureRequest) -> tuple[Storage, str]:
    bucket: str = request.getfixturevalue("s3_bucket")
    return resolve(f"{bucket}/root", StorageOptions(thread_count=4, retry_deadline=20))


BACKENDS: dict[str, Callable[[pytest.FixtureRequest], tuple[Storage, str]]] = {
    "local": _local,
    "gcs": _gcs,
    "s3": _s3,
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> tuple[Storage, str]:
    return BACKENDS[request.param](request)


def test_write_read_size_exists(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    loc = storage.join(root, "a", "b.bin")
    data = bytes(range(256)) * 40
    assert not storage.exists(loc)
    storage.write_bytes(loc, data)
    assert storage.exists(loc)
    assert storage.size(loc) == len(data)
    assert storage.read_bytes(loc) == data
    assert storage.read_bytes(loc, 100, 300) == data[100:300]
    assert storage.read_bytes(loc, 10_000) == data[10_000:]
    assert storage.read_bytes(loc, 5, 5) == b""


def test_missing_file_raises_file_not_found_naming_it(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    loc = storage.join(root, "nope.bin")
    for call in (
        lambda: storage.size(loc),
        lambda: storage.read_bytes(loc),
        lambda: storage.read_bytes(loc, 1, 2),
        lambda: storage.open_read(loc),
        lambda: storage.local_copy(loc, Path("/tmp") / "unused-cache"),
    ):
        with pytest.raises(FileNotFoundError) as info:
            call()
        assert isinstance(info.value, CheckpointNotFoundError)
        assert "nope.bin" in str(info.value)


def test_create_only_write_refuses_existing_and_keeps_it(
    backend: tuple[Storage, str], tmp_path: Path
) -> None:
    storage, root = backend
    loc = storage.join(root, ".metadata.json")
    storage.write_bytes(loc, b"first", overwrite=False)
    with pytest.raises(FileExistsError) as info:
        storage.write_bytes(loc, b"second", overwrite=False)
    assert isinstance(info.value, CheckpointExistsError) and ".metadata.json" in str(info.value)
    local = tmp_path / "upload.bin"
    local.write_bytes(b"third")
    with pytest.raises(CheckpointExistsError):
        storage.upload(local, loc, overwrite=False)
    assert storage.read_bytes(loc) == b"first"
    storage.write_bytes(loc, b"replaced")
    assert storage.read_bytes(loc) == b"replaced"


def test_racing_create_only_writes_one_wins(backend: tuple[Storage, str]) -> None:
    """Eight writers race for one commit record; the precondition lets exactly one through."""
    storage, root = backend
    loc = storage.join(root, "race", ".metadata.json")

    def attempt(i: int) -> str:
        try:
            storage.write_bytes(loc, f"writer {i}".encode(), overwrite=False)
            return "won"
        except CheckpointExistsError:
            return "refused"

    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(attempt, range(8)))
    assert outcomes.count("won") == 1, outcomes
    winner = outcomes.index("won")
    assert storage.read_bytes(loc) == f"writer {winner}".encode()


def test_copy_file_is_create_only(backend: tuple[Storage, str]) -> None:
    """A copy holds the source's bytes, never replaces an existing file, and names what is
    missing; the source stays."""
    storage, root = backend
    src = storage.join(root, "step3", "model", "__0_0.distcp")
    dst = storage.join(root, "step3-replaced", "model", "__0_0.distcp")
    data = bytes(range(256)) * 64
    storage.write_bytes(src, data)
    storage.copy_file(src, dst)
    assert storage.read_bytes(dst) == data and storage.read_bytes(src) == data
    other = storage.join(root, "other.bin")
    storage.write_bytes(other, b"other")
    with pytest.raises(CheckpointExistsError, match="__0_0.distcp"):
        storage.copy_file(other, dst)
    assert storage.read_bytes(dst) == data
    with pytest.raises(CheckpointNotFoundError, match="nope.bin"):
        storage.copy_file(storage.join(root, "nope.bin"), storage.join(root, "x.bin"))
    assert not storage.exists(storage.join(root, "x.bin"))


@pytest.fixture(params=["gcs", "s3"])
def object_store(request: pytest.FixtureRequest) -> tuple[Storage, str]:
    """The back ends with compare-and-swap writes (claims on step prefixes need them)."""
    return BACKENDS[request.param](request)


def test_versioned_writes_are_compare_and_swap(object_store: tuple[Storage, str]) -> None:
    storage, root = object_store
    loc = storage.join(root, "step1", ".claim")
    with pytest.raises(FileNotFoundError):
        storage.read_versioned(loc)
    v1 = storage.write_versioned(loc, b"one", version=None)
    assert storage.read_versioned(loc) == Versioned(b"one", v1)
    with pytest.raises(FileExistsError):
        storage.write_versioned(loc, b"two", version=None)  # create-only: it exists
    v2 = storage.write_versioned(loc, b"two", version=v1)
    assert v2 != v1 and storage.read_versioned(loc) == Versioned(b"two", v2)
    with pytest.raises(FileExistsError):
        storage.write_versioned(loc, b"three", version=v1)  # v1 is stale
    assert storage.read_versioned(loc) == Versioned(b"two", v2)
    storage.delete_files([loc])
    with pytest.raises(FileNotFoundError):
        storage.write_versioned(loc, b"four", version=v2)  # gone


def test_racing_compare_and_swap_writes_one_wins(object_store: tuple[Storage, str]) -> None:
    """Eight writers replace the same version at once; exactly one gets through."""
    storage, root = object_store
    loc = storage.join(root, "race", ".claim")
    for trial in range(3):
        base = storage.write_versioned(loc, f"base {trial}".encode(), version=None)

        def attempt(i: int, base: str = base, trial: int = trial) -> str:
            try:
                storage.write_versioned(loc, f"writer {trial}.{i}".encode(), version=base)
                return "won"
            except FileExistsError:
                return "refused"

        with ThreadPoolExecutor(8) as pool:
            outcomes = list(pool.map(attempt, range(8)))
        assert outcomes.count("won") == 1, outcomes
        winner = outcomes.index("won")
        assert storage.read_versioned(loc).data == f"writer {trial}.{winner}".encode()
        storage.delete_files([loc])


def test_upload_many_and_listings(backend: tuple[Storage, str], tmp_path: Path) -> None:
    storage, root = backend
    rels = ["step1/.metadata.json", "step1/train/rank0.pt", "step2/model/__0_0.distcp", "top.txt"]
    pairs = []
    for i, rel in enumerate(rels):
        local = tmp_path / f"src{i}"
        local.write_bytes(rel.encode() * (i + 1))
        pairs.append((local, storage.join(root, rel)))
    storage.upload_many(pairs)
    for local, loc in pairs:
        assert storage.read_bytes(loc) == local.read_bytes()

    listing = storage.list_dir(root)
    assert listing.dirs == ["step1", "step2"]
    assert listing.files == {"top.txt": len(b"top.txt") * 4}
    assert storage.list_files(storage.join(root, "step1")) == {
        ".metadata.json": len(rels[0]),
        "train/rank0.pt": len(rels[1]) * 2,
    }
    assert sorted(storage.list_files(root)) == sorted(rels)


def test_large_file_upload_round_trips(backend: tuple[Storage, str], tmp_path: Path) -> None:
    """Above GCS's 8 MiB one-request limit: a resumable (chunked) upload, checked the same."""
    storage, root = backend
    local = tmp_path / "big.bin"
    data = uuid.uuid4().bytes * (9 * 1024 * 1024 // 16 + 1)
    local.write_bytes(data)
    loc = storage.join(root, "model_and_optim", "__0_0.distcp")
    storage.upload_many([(local, loc)])
    assert storage.size(loc) == len(data)
    assert storage.read_bytes(loc, len(data) - 100) == data[-100:]
    assert crc32c_bytes(storage.read_bytes(loc)) == crc32c_bytes(data)


def test_delete_tree_removes_first_files_first_and_ignores_missing(
    backend: tuple[Storage, str],
) -> None:
    storage, root = backend
    ckpt = storage.join(root, "step7")
    for rel in (".metadata.json", "train/rank0.pt", "model_and_optim/.metadata"):
        storage.write_bytes(storage.join(ckpt, rel), b"x")
    storage.delete_files([storage.join(ckpt, "does-not-exist")])
    storage.delete_tree(ckpt, first=[".metadata.json"])
    assert not storage.exists(storage.join(ckpt, ".metadata.json"))
    assert not storage.exists(storage.join(ckpt, "train/rank0.pt"))
    assert "step7" not in storage.list_dir(root).dirs
    storage.delete_tree(ckpt)  # already gone: no error


def test_open_read_seeks_and_reads_ranges(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    loc = storage.join(root, "shard.bin")
    data = uuid.uuid4().bytes * 1000
    storage.write_bytes(loc, data)
    with storage.open_read(loc) as f:
        f.seek(1000)
        assert f.read(24) == data[1000:1024]
        assert f.tell() == 1024
        f.seek(-16, 2)
        assert f.read() == data[-16:]
        f.seek(0)
        assert f.read() == data


def test_local_copy_holds_the_bytes(backend: tuple[Storage, str], tmp_path: Path) -> None:
    storage, root = backend
    loc = storage.join(root, "blob.bin")
    storage.write_bytes(loc, b"payload" * 100)
    copy = storage.local_copy(loc, tmp_path / "cache")
    assert copy.read_bytes() == b"payload" * 100


def test_paths(backend: tuple[Storage, str]) -> None:
    storage, root = backend
    child = storage.join(root, "step3")
    assert storage.parent(child) == root
    assert storage.name(child) == "step3"
    assert storage.normalize(child + "/") == child


def test_gcs_reports_the_crc32c_we_computed(gcs_bucket: str) -> None:
    """What GCS stores is checked against the CRC32C we computed: it must equal ours."""
    from google.cloud import storage as gcs

    storage, root = resolve(f"{gcs_bucket}/crc")
    data = b"some checkpoint bytes" * 1000
    storage.write_bytes(storage.join(root, "f.bin"), data)
    blob = gcs.Client().bucket(gcs_bucket[len("gs://") :]).get_blob("crc/f.bin")
    from trainckpt.storage.checksums import crc32c_from_gcs

    assert blob is not None and crc32c_from_gcs(blob.crc32c) == crc32c_bytes(data)


def test_gcs_missing_bucket_is_a_clear_error(gcs_bucket: str) -> None:
    storage, root = resolve("gs://no-such-bucket-trainckpt/x")
    with pytest.raises(StorageError, match="bucket does not exist"):
        storage.write_bytes(storage.join(root, "f"), b"1")
    with pytest.raises(FileNotFoundError, match="no-such-bucket-trainckpt"):
        storage.list_dir(root)
