"""`Storage.copy_file` takes the cheap path of each back end, with no byte passing through this
process: a hard link on a filesystem (a byte copy only where the filesystem refuses links), a
server-side copy on fake-gcs-server and on moto; HTTP refuses. What every back end promises
(create-only, missing source) is in `tests/contract/test_storage_contract.py`."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.s3_server import S3Proxy

from trainckpt.errors import CheckpointError, CheckpointExistsError
from trainckpt.storage import LocalStorage, StorageOptions, storage_for
from trainckpt.storage.gcs import GCSStorage
from trainckpt.storage.s3 import MIN_PART_SIZE, S3Storage

OPTIONS = StorageOptions(thread_count=4, retry_deadline=20)


def test_local_copy_is_a_hard_link(tmp_path: Path) -> None:
    src, dst = tmp_path / "step3" / "a.distcp", tmp_path / "step3-replaced" / "a.distcp"
    src.parent.mkdir()
    src.write_bytes(b"shard bytes")
    LocalStorage().copy_file(str(src), str(dst))
    assert dst.read_bytes() == b"shard bytes"
    assert os.path.samefile(src, dst)  # one inode: nothing was copied


@pytest.fixture
def other_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A folder on another filesystem than `tmp_path` (tmpfs), where hard links fail (EXDEV)."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == tmp_path.stat().st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's tmp_path")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        yield Path(d)


def test_local_copy_across_filesystems_copies_the_bytes(
    tmp_path: Path, other_filesystem: Path
) -> None:
    src = other_filesystem / "a.distcp"
    src.write_bytes(b"x" * 100_000)
    dst = tmp_path / "copy" / "a.distcp"
    LocalStorage().copy_file(str(src), str(dst))
    assert dst.read_bytes() == b"x" * 100_000
    assert not os.path.samefile(src, dst)
    assert [p.name for p in dst.parent.iterdir()] == ["a.distcp"]  # no temp file left
    with pytest.raises(CheckpointExistsError, match="a.distcp"):
        LocalStorage().copy_file(str(src), str(dst))


def test_gcs_copy_is_server_side(gcs_bucket: str) -> None:
    storage = GCSStorage(OPTIONS)  # its own client: the hook below stays in this test
    sent: list[tuple[str, str, int]] = []

    def record(response: Any, *args: Any, **kwargs: Any) -> None:
        req = response.request
        sent.append((req.method, req.url, len(req.body or b"")))

    src, dst = f"{gcs_bucket}/step3/a.distcp", f"{gcs_bucket}/step3-replaced/a.distcp"
    data = os.urandom(300_000)
    storage.write_bytes(src, data)
    storage.client._http.hooks["response"].append(record)
    storage.copy_file(src, dst)
    assert storage.read_bytes(dst) == data
    rewrites = [s for s in sent if "/rewriteTo/" in s[1]]
    assert rewrites and all("ifGenerationMatch=0" in url for _, url, _ in rewrites), sent
    assert not [s for s in sent if "/upload/" in s[1] or s[2] >= len(data)], sent


def test_s3_copy_is_server_side(s3_bucket: str, s3_proxy: S3Proxy) -> None:
    storage = storage_for(s3_bucket, OPTIONS)
    src, dst = f"{s3_bucket}/step3/a.distcp", f"{s3_bucket}/step3-replaced/a.distcp"
    data = os.urandom(300_000)
    storage.write_bytes(src, data)
    before = len(s3_proxy.requests)
    storage.copy_file(src, dst)
    assert storage.read_bytes(dst) == data
    copies = s3_proxy.requests[before:]
    assert [r.operation for r in copies if r.method == "PUT"] == ["CopyObject"]
    assert all(len(r.body) < 1000 for r in copies)


def test_s3_copy_of_a_large_object_goes_in_parts(s3_bucket: str, s3_proxy: S3Proxy) -> None:
    """Past `copy_threshold` (5 GiB on S3, where one CopyObject stops), parts are copied."""
    storage = S3Storage(
        OPTIONS, part_size=MIN_PART_SIZE, copy_threshold=MIN_PART_SIZE, multipart_threshold=1 << 40
    )
    src, dst = f"{s3_bucket}/big/a.distcp", f"{s3_bucket}/big-replaced/a.distcp"
    data = os.urandom(2 * MIN_PART_SIZE + 17)
    storage.write_bytes(src, data)
    before = len(s3_proxy.requests)
    storage.copy_file(src, dst)
    assert storage.read_bytes(dst) == data
    ops = [r.operation for r in s3_proxy.requests[before:]]
    assert ops.count("UploadPartCopy") == 3 and "CompleteMultipartUpload" in ops
    assert "UploadPart" not in ops and "PutObject" not in ops and "CopyObject" not in ops
    assert all(len(r.body) < 10_000 for r in s3_proxy.requests[before:])


def test_http_refuses_to_copy() -> None:
    storage = storage_for("http://127.0.0.1:1/ckpt")
    with pytest.raises(CheckpointError, match="read-only"):
        storage.copy_file("http://127.0.0.1:1/ckpt/a", "http://127.0.0.1:1/ckpt/b")
