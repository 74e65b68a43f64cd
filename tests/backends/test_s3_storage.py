"""The S3 back end against a real S3-compatible server (moto, on 127.0.0.1): what the shared
contract suite does not cover — multipart uploads, retries of throttling and 5xx answers bounded
by the deadline, listings and deletes past S3's 1,000-key pages, and the endpoint variables."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from support.s3_server import Gate, MotoS3, S3Proxy, write_local

from trainckpt.errors import CheckpointExistsError, CheckpointNotFoundError, StorageError
from trainckpt.storage import StorageOptions, resolve, storage_for
from trainckpt.storage.s3 import MIN_PART_SIZE, S3Storage

MiB = 1024 * 1024


def small_parts(retry_deadline: float = 20.0) -> S3Storage:
    """A back end that uploads anything of 5 MiB or more in 5 MiB parts (S3's minimum)."""
    return S3Storage(
        StorageOptions(thread_count=4, retry_deadline=retry_deadline),
        multipart_threshold=MIN_PART_SIZE,
        part_size=MIN_PART_SIZE,
    )


def test_storage_for_picks_s3_and_import_does_not_load_boto3(s3_bucket: str) -> None:
    storage, loc = resolve(f"{s3_bucket}/runs/a/")
    assert isinstance(storage, S3Storage)
    assert loc == f"{s3_bucket}/runs/a"
    assert storage_for(loc) is storage  # one shared client per options and endpoint
    code = "import sys, trainckpt; assert 'boto3' not in sys.modules, 'boto3 imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_multipart_upload_sends_parts_in_parallel(
    s3_bucket: str, s3_proxy: S3Proxy, s3_server: MotoS3, tmp_path: Path
) -> None:
    data = os.urandom(3 * MIN_PART_SIZE + 123)
    local = write_local(tmp_path / "shard.distcp", data)
    # Each part is held until two are in flight: a sequential upload would never meet the gate.
    s3_proxy.gate = Gate(lambda r: r.operation == "UploadPart", count=2, timeout=20)
    storage = small_parts()
    loc = f"{s3_bucket}/ckpt/model_and_optim/__0_0.distcp"
    storage.upload(local, loc)
    assert s3_proxy.gate.met.is_set(), "parts were not uploaded in parallel"
    assert len(s3_proxy.ops("UploadPart")) == 4
    assert not s3_proxy.ops("PutObject")
    assert storage.read_bytes(loc) == data
    assert (
        storage.read_bytes(loc, MIN_PART_SIZE - 10, MIN_PART_SIZE + 10)
        == data[MIN_PART_SIZE - 10 : MIN_PART_SIZE + 10]
    )


def test_create_only_multipart_upload_is_refused_and_keeps_the_object(
    s3_bucket: str, tmp_path: Path
) -> None:
    storage = small_parts()
    loc = f"{s3_bucket}/ckpt/big.bin"
    first = os.urandom(MIN_PART_SIZE + 1)
    storage.upload(write_local(tmp_path / "a", first), loc, overwrite=False)
    second = write_local(tmp_path / "b", os.urandom(MIN_PART_SIZE + 2))
    with pytest.raises(CheckpointExistsError, match="big.bin"):
        storage.upload(second, loc, overwrite=False)
    assert storage.read_bytes(loc) == first


def test_failed_part_aborts_the_upload_and_leaves_nothing(
    s3_bucket: str, s3_proxy: S3Proxy, s3_server: MotoS3, tmp_path: Path
) -> None:
    s3_proxy.fail(lambda r: r.operation == "UploadPart", 403, "AccessDenied", times=100)
    storage = small_parts()
    loc = f"{s3_bucket}/ckpt/denied.bin"
    with pytest.raises(StorageError, match="denied.bin") as info:
        storage.upload(write_local(tmp_path / "x", os.urandom(2 * MIN_PART_SIZE)), loc)
    assert "credentials" in str(info.value)
    assert len(s3_proxy.ops("AbortMultipartUpload")) == 1
    bucket = s3_bucket.removeprefix("s3://")
    assert not s3_server.client().list_multipart_uploads(Bucket=bucket).get("Uploads")
    assert not storage.exists(loc)


def test_throttling_and_5xx_are_retried(s3_bucket: str, s3_proxy: S3Proxy) -> None:
    s3_proxy.fail(lambda r: r.operation == "PutObject", 503, "SlowDown", times=2)
    s3_proxy.fail(lambda r: r.operation == "GetObject", 500, "InternalError", times=1)
    s3_proxy.fail(lambda r: r.operation == "ListObjectsV2", 503, "SlowDown", times=1)
    storage = S3Storage(StorageOptions(retry_deadline=30))
    loc = f"{s3_bucket}/ckpt/.metadata.json"
    storage.write_bytes(loc, b'{"ephemeral": false}', overwrite=False)
    assert storage.read_bytes(loc) == b'{"ephemeral": false}'
    assert storage.list_files(f"{s3_bucket}/ckpt") == {".metadata.json": 20}
    assert len(s3_proxy.ops("PutObject")) == 3  # two throttled, one stored
    assert len(s3_proxy.ops("GetObject")) == 2
    assert len(s3_proxy.ops("ListObjectsV2")) == 2


def test_retries_stop_at_the_deadline_with_a_clear_error(s3_bucket: str, s3_proxy: S3Proxy) -> None:
    s3_proxy.fail(lambda r: r.operation == "HeadObject", 503, "SlowDown", times=10_000)
    storage = S3Storage(StorageOptions(retry_deadline=1.0))
    loc = f"{s3_bucket}/ckpt/train/rank0.pt"
    with pytest.raises(StorageError) as info:
        storage.size(loc)
    message = str(info.value)
    assert loc in message and "retry_deadline=1s" in message and "HTTP 503" in message
    assert len(s3_proxy.ops("HeadObject")) > 1  # it did retry before giving up


def test_dropped_connections_are_retried_and_a_dead_endpoint_fails_at_the_deadline(
    s3_bucket: str, s3_proxy: S3Proxy, tmp_path: Path
) -> None:
    s3_proxy.fail(lambda r: r.operation == "UploadPart", 0, "", times=2)
    s3_proxy.fail(lambda r: r.operation == "GetObject", 0, "", times=1)
    storage = small_parts()
    loc = f"{s3_bucket}/ckpt/shard.distcp"
    data = os.urandom(2 * MIN_PART_SIZE)
    storage.upload(write_local(tmp_path / "shard", data), loc)
    assert storage.read_bytes(loc) == data
    assert len(s3_proxy.ops("UploadPart")) == 4  # two parts, two of their sends dropped

    s3_proxy.shutdown()  # nothing answers at the endpoint any more
    s3_proxy.server_close()
    with pytest.raises(StorageError, match="retry_deadline=1s") as info:
        S3Storage(StorageOptions(retry_deadline=1.0)).read_bytes(loc)
    assert loc in str(info.value) and "attempts" in str(info.value)


def test_a_retried_create_only_put_that_finds_its_own_object_succeeds(
    s3_bucket: str, s3_proxy: S3Proxy
) -> None:
    """When the answer to a create-only put is lost, the retried put meets the object the
    first attempt stored. Same bytes as ours: success, not 'already exists'.

    The client sees the same thing as for a lost answer when the object is stored first and
    the put then fails once with a 500 and is retried; that is what the proxy arranges.
    """
    storage = S3Storage(StorageOptions(retry_deadline=30))
    loc = f"{s3_bucket}/ckpt/.metadata.json"
    storage.write_bytes(loc, b"record", overwrite=False)
    s3_proxy.fail(lambda r: r.operation == "PutObject", 500, "InternalError", times=1)
    with pytest.raises(CheckpointExistsError):
        storage.write_bytes(loc, b"other record", overwrite=False)
    s3_proxy.fail(lambda r: r.operation == "PutObject", 500, "InternalError", times=1)
    storage.write_bytes(loc, b"record", overwrite=False)  # its own bytes after a retry
    with pytest.raises(CheckpointExistsError):
        storage.write_bytes(loc, b"record", overwrite=False)  # no retry: a real conflict


def test_listing_and_deleting_more_than_1000_objects(
    s3_bucket: str, s3_proxy: S3Proxy, s3_server: MotoS3
) -> None:
    keys = [f"big/d{i:04d}/f" for i in range(1005)] + ["big/top.bin"]
    s3_server.put_many(s3_bucket.removeprefix("s3://"), keys, b"xy")

    storage = S3Storage(StorageOptions(retry_deadline=30))
    listing = storage.list_dir(f"{s3_bucket}/big")
    assert listing.dirs == [f"d{i:04d}" for i in range(1005)]
    assert listing.files == {"top.bin": 2}
    files = storage.list_files(f"{s3_bucket}/big")
    assert len(files) == 1006 and files["d1004/f"] == 2
    assert len(s3_proxy.ops("ListObjectsV2")) == 4  # two pages per listing

    storage.delete_tree(f"{s3_bucket}/big", first=["top.bin"])
    batches = [r.body.count(b"<Key>") for r in s3_proxy.ops("DeleteObjects")]
    assert batches == [1, 1000, 5]  # the first file alone, then the rest in batches of 1000
    assert b"big/top.bin" in s3_proxy.ops("DeleteObjects")[0].body
    assert storage.list_files(f"{s3_bucket}/big") == {}


def test_missing_bucket_and_empty_prefix(s3_server: MotoS3, s3_bucket: str) -> None:
    storage = S3Storage(StorageOptions(retry_deadline=10))
    with pytest.raises(CheckpointNotFoundError, match="no-such-bucket-here.*does not exist"):
        storage.list_dir("s3://no-such-bucket-here/runs")
    with pytest.raises(CheckpointNotFoundError):
        storage.read_bytes("s3://no-such-bucket-here/runs/x")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist") as info:
        storage.write_bytes("s3://no-such-bucket-here/runs/x", b"1")
    assert not isinstance(info.value, FileNotFoundError)
    assert storage.list_dir(f"{s3_bucket}/nothing/here").dirs == []
    assert storage.list_files(f"{s3_bucket}/nothing/here") == {}
    with pytest.raises(StorageError, match="names no bucket"):
        storage.size("s3:///key")


def test_endpoint_comes_from_aws_endpoint_url_s3(
    s3_bucket: str, s3_proxy: S3Proxy, s3_server: MotoS3
) -> None:
    # The fixture pointed AWS_ENDPOINT_URL_S3 at the proxy: a back end made now talks to it.
    via_proxy, loc = resolve(f"{s3_bucket}/x.bin")
    via_proxy.write_bytes(loc, b"123")
    assert [r.path for r in s3_proxy.ops("PutObject")][-1].endswith("/x.bin")
    os.environ["AWS_ENDPOINT_URL_S3"] = s3_server.url
    direct, _ = resolve(loc)
    assert direct is not via_proxy  # a changed endpoint gets its own client
    assert direct.read_bytes(loc) == b"123"
    assert not s3_proxy.ops("GetObject")
