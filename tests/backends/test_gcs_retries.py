"""Retries against real HTTP errors: a proxy in front of fake-gcs-server answers some requests
with 408/429/5xx (retried with backoff until `retry_deadline`) or 403 (not retried)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from support.servers import FakeGCS, GCSFaultProxy, fault_proxy

from trainckpt.errors import CheckpointExistsError, StorageError
from trainckpt.storage import StorageOptions, storage_for
from trainckpt.storage.gcs import GCSStorage


def _storage(deadline: float = 20.0) -> GCSStorage:
    storage = storage_for("gs://x", StorageOptions(thread_count=4, retry_deadline=deadline))
    assert isinstance(storage, GCSStorage)
    return storage


@pytest.fixture
def gcs_proxy(gcs_server: FakeGCS) -> Iterator[GCSFaultProxy]:
    with fault_proxy(gcs_server) as proxy:
        yield proxy


@pytest.fixture
def bucket(gcs_server: FakeGCS, gcs_proxy: GCSFaultProxy) -> str:
    return f"gs://{gcs_server.create_bucket()}"


@pytest.mark.parametrize("status", [408, 429, 500, 502, 503, 504])
def test_transient_errors_are_retried(bucket: str, gcs_proxy: GCSFaultProxy, status: int) -> None:
    storage = _storage()
    loc = f"{bucket}/step1/.metadata.json"
    gcs_proxy.fail("POST", "/upload/", status, times=2)
    storage.write_bytes(loc, b'{"ephemeral": false}', overwrite=False)  # create-only, retried
    assert gcs_proxy.count("POST", "/upload/") == 3
    gcs_proxy.fail("GET", "/o", status, times=1)  # a listing, then a download
    assert storage.list_dir(f"{bucket}/step1").files == {".metadata.json": 20}
    gcs_proxy.fail("GET", "alt=media", status, times=1)
    assert storage.read_bytes(loc) == b'{"ephemeral": false}'
    with pytest.raises(CheckpointExistsError):  # the precondition still holds after retries
        storage.write_bytes(loc, b"other", overwrite=False)


def test_a_persistent_503_gives_up_at_the_deadline(bucket: str, gcs_proxy: GCSFaultProxy) -> None:
    storage = _storage(deadline=1.5)
    gcs_proxy.fail("POST", "/upload/", 503, times=10_000)
    with pytest.raises(StorageError, match="retry_deadline=1.5s") as info:
        storage.write_bytes(f"{bucket}/f", b"1")
    assert "503" in str(info.value)
    assert gcs_proxy.count("POST", "/upload/") >= 2, "it was not retried"


def test_permission_errors_are_not_retried(bucket: str, gcs_proxy: GCSFaultProxy) -> None:
    storage = _storage()
    gcs_proxy.fail("POST", "/upload/", 403, times=1)
    with pytest.raises(StorageError, match="credentials"):
        storage.write_bytes(f"{bucket}/f", b"1")
    assert gcs_proxy.count("POST", "/upload/") == 1


def test_bytes_damaged_in_transfer_fail_the_upload(
    bucket: str, gcs_proxy: GCSFaultProxy, tmp_path: Path
) -> None:
    """The proxy flips bytes of the body; the server stores and checksums the damaged bytes,
    and the CRC32C it reports no longer matches the one computed locally."""
    storage = _storage()
    data = b"0123456789" * 1000 + b"TENSOR-BYTES" + b"9876543210" * 1000
    local = tmp_path / "shard.distcp"
    local.write_bytes(data)
    gcs_proxy.corrupt(b"TENSOR-BYTES", b"TENSOR-BYTEZ")
    with pytest.raises(StorageError, match="corrupted in transfer"):
        storage.upload_many([(local, f"{bucket}/step1/model_and_optim/__0_0.distcp")])
    storage.upload(local, f"{bucket}/step1/model_and_optim/__0_0.distcp")  # clean retry
    assert storage.read_bytes(f"{bucket}/step1/model_and_optim/__0_0.distcp") == data
