"""Loading published checkpoints over http:// from a real local server (ETag, Range, HEAD): what
only HTTP does (the round trip, deep verify and a missing checkpoint over http:// are in
`contract/test_checkpointer_contract.py`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import Checkpointer, CheckpointerConfig, ConfigurationError
from trainckpt.storage import resolve

pytestmark = pytest.mark.ckpt(retry_deadline=10)


@pytest.fixture
def published(http_folder: tuple[Path, str], tmp_path: Path):
    """A checkpoint saved to a local folder that the HTTP server publishes: (module, URL)."""
    folder, url = http_folder
    module = make_module(steps=3)
    c = CheckpointerConfig(work_dir=tmp_path / "save-work").build()
    c.save(folder / "step3", module, {"step": 3, "note": "published"})
    c.close()
    return module, f"{url}/step3"


def test_load_over_http_reads_byte_ranges(published, ckpt, http_server):
    src, url = published
    assert Checkpointer.dir_is_checkpoint(url)
    assert Checkpointer.read_metadata(url).ephemeral is False
    http_server.requests.clear()

    dst = fresh_module()
    state = ckpt.load(url, dst)
    assert state == {"step": 3, "note": "published"}
    assert_same_state(src, dst)
    shard_gets = [r for m, p, r in http_server.requests if p.endswith(".distcp") and m == "GET"]
    assert shard_gets, "the shard was not read over HTTP"
    assert all(r is not None and r.startswith("bytes=") for r in shard_gets), shard_gets
    assert not (ckpt.work_dir / "download-cache").exists(), "no download without pre_download"


def test_pre_download_caches_by_etag_and_notices_a_changed_file(published, http_folder, tmp_path):
    src, url = published
    c = CheckpointerConfig(work_dir=tmp_path / "work", pre_download=True).build()
    try:
        dst = fresh_module()
        c.load(url, dst)
        assert_same_state(src, dst)
        cache = tmp_path / "work" / "download-cache"
        assert any(p.is_file() for p in cache.rglob("*")), "shards were not downloaded"

        # The publisher replaces the checkpoint: same URLs, new bytes, new ETags.
        folder, _ = http_folder
        newer = make_module(seed=9, steps=1)
        w = CheckpointerConfig(work_dir=tmp_path / "w2", save_overwrite=True).build()
        w.save(folder / "step3", newer, {"step": 3})
        w.close()
        dst2 = fresh_module()
        c.load(url, dst2)
        assert_same_state(newer, dst2)
    finally:
        c.close()


def test_a_missing_files_local_copy_is_file_not_found_naming_it(ckpt, http_folder):
    """(`contract/test_checkpointer_contract.py` loads a missing checkpoint over http://.)"""
    _, url = http_folder
    missing = f"{url}/step404"
    storage, loc = resolve(f"{missing}/model_and_optim/.metadata")
    with pytest.raises(FileNotFoundError, match="step404"):
        storage.local_copy(loc, Path(ckpt.work_dir) / "cache")


def test_http_folders_cannot_be_listed_or_written(published, ckpt, http_folder):
    _, url = http_folder
    with pytest.raises(ConfigurationError, match="cannot be listed"):
        list(Checkpointer.find_checkpoints(url))
    with pytest.raises(ConfigurationError, match="cannot be listed"):
        Checkpointer.latest_checkpoint(url)
    with pytest.raises(ConfigurationError, match="read-only"):
        ckpt.save(f"{url}/step9", make_module(), {"step": 9})


def test_unreachable_http_server_is_a_storage_error(tmp_path):
    from support.ports import free_port

    from trainckpt.errors import StorageError
    from trainckpt.storage import StorageOptions, storage_for

    url = f"http://127.0.0.1:{free_port()}/step1/.metadata.json"
    storage = storage_for(url, StorageOptions(retry_deadline=1.0))
    with pytest.raises(StorageError, match="retry_deadline=1s"):
        storage.read_bytes(url)


def test_transient_http_errors_are_retried(published, http_server):
    _, url = published
    path = url[len(http_server.url) :] + "/.metadata.json"
    http_server.failure_path = path
    http_server.failures[:] = [503, 429, 502]
    assert Checkpointer.read_metadata(url).ephemeral is False  # HEAD-free: one GET, retried
    retried = [r for r in http_server.requests if r[1] == path]
    assert len(retried) == 4, retried


def test_server_that_refuses_head_still_loads(published, ckpt, http_server):
    src, url = published
    http_server.refuse_head = True
    dst = fresh_module()
    ckpt.load(url, dst)
    assert_same_state(src, dst)
    assert any(m == "HEAD" for m, _, _ in http_server.requests)
