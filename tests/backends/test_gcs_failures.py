"""A GCS server that dies during a save: the save fails with a clear error within the retry
deadline, and nothing is reported committed. Uses its own fake-gcs-server (on disk, so it can be
restarted to inspect what is left) so the session's server keeps working."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from support.models import make_module
from support.servers import FakeGCS, use_emulator

from trainckpt import Checkpointer, CheckpointerConfig
from trainckpt.errors import StorageError
from trainckpt.storage import StorageOptions, storage_for

RETRY_DEADLINE = 3.0


@pytest.fixture
def own_server(tmp_path: Path, gcs_server: FakeGCS) -> Iterator[FakeGCS]:
    server = FakeGCS(tmp_path, root=tmp_path / "objects").start()
    use_emulator(server.url)
    try:
        yield server
    finally:
        server.stop()
        use_emulator(gcs_server.url)


def test_server_killed_mid_upload_fails_within_deadline_and_commits_nothing(
    own_server: FakeGCS, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bucket = own_server.create_bucket()
    target = f"gs://{bucket}/run/step1"
    ckpt = CheckpointerConfig(
        work_dir=tmp_path / "work", retry_deadline=RETRY_DEADLINE, save_thread_count=1
    ).build()

    # The checkpointer's own back end: let its first upload through, kill the server when the
    # second one starts. The uploads themselves are real.
    storage = storage_for(target, StorageOptions(thread_count=1, retry_deadline=RETRY_DEADLINE))
    real_upload = storage.upload
    uploads: list[str] = []
    lock = threading.Lock()

    def upload_then_kill(local: Path, location: str, *, overwrite: bool = True) -> None:
        with lock:
            uploads.append(location)
            if len(uploads) == 2:
                own_server.kill()
        real_upload(local, location, overwrite=overwrite)

    monkeypatch.setattr(storage, "upload", upload_then_kill)

    # Bound the wait well below the SDK's default retry (80-120 s seen here): a save that
    # ignored retry_deadline would hang past it and fail this test.
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(ckpt.save, target, make_module(), {"step": 1})
        with pytest.raises(StorageError) as info:
            future.result(timeout=RETRY_DEADLINE + 40)
    ckpt.close()
    message = str(info.value)
    assert "retry_deadline" in message and target in message, message
    assert len(uploads) >= 2, "the server was not killed during the uploads"
    assert not list((tmp_path / "work").glob("staging-*")), "staging must be cleaned up"

    # Restart the same server on the same disk and port: what did the dead save leave?
    restarted = FakeGCS(tmp_path, root=own_server.root, port=own_server.port).start()
    monkeypatch.undo()
    from google.cloud import storage as gcs

    try:
        names = {b.name for b in gcs.Client().list_blobs(bucket)}
        assert f"run/step1/{uploads[0].split('/step1/')[1]}" in names  # the first upload landed
        assert "run/step1/.metadata.json" not in names
        assert not Checkpointer.dir_is_checkpoint(target)
        assert list(Checkpointer.find_checkpoints(f"gs://{bucket}/run")) == []
        assert not Checkpointer.contains_checkpoint(f"gs://{bucket}/run")
    finally:
        restarted.stop()


def test_unreachable_server_is_a_storage_error_not_an_sdk_error(
    own_server: FakeGCS, tmp_path: Path
) -> None:
    bucket = own_server.create_bucket()
    own_server.kill()
    storage = storage_for(f"gs://{bucket}", StorageOptions(retry_deadline=1.0))
    for call in (
        lambda: storage.size(f"gs://{bucket}/x"),
        lambda: storage.list_dir(f"gs://{bucket}"),
        lambda: storage.write_bytes(f"gs://{bucket}/x", b"1", overwrite=False),
    ):
        with pytest.raises(StorageError, match="retry_deadline=1s"):
            call()
    assert os.environ["STORAGE_EMULATOR_HOST"] == own_server.url
