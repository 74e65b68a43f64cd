"""Checkpointer against a real fake-gcs-server: save, save_async, load and finders on gs://."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from google.cloud import storage as gcs
from support.models import assert_same_state, fresh_module, make_module

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointExistsError,
    CheckpointManifest,
    CheckpointNotFoundError,
)
from trainckpt.storage.checksums import crc32c_from_gcs


@pytest.fixture
def ckpt(tmp_path: Path):
    c = CheckpointerConfig(work_dir=tmp_path / "work", retry_deadline=30).build()
    yield c
    c.close()


def _objects(url: str) -> dict[str, gcs.Blob]:
    """Every object under `url` (a gs:// folder), read with the plain SDK, by relative name."""
    bucket, _, prefix = url[len("gs://") :].partition("/")
    return {
        b.name[len(prefix) + 1 :]: b for b in gcs.Client().list_blobs(bucket, prefix=prefix + "/")
    }


def test_round_trip_to_and_from_gs(ckpt, gcs_bucket):
    src = make_module(steps=3)
    state = {"step": 3, "rng": torch.get_rng_state(), "data": {"epoch": 1}}
    path = ckpt.save(f"{gcs_bucket}/run/step3/", src, state)
    assert path == f"{gcs_bucket}/run/step3"
    assert Checkpointer.dir_is_checkpoint(path)
    assert ".metadata.json" in _objects(path)

    dst = fresh_module()
    loaded = ckpt.load(path, dst)
    assert_same_state(src, dst)
    assert loaded is not None and loaded["step"] == 3 and loaded["data"] == {"epoch": 1}
    assert torch.equal(loaded["rng"], state["rng"])
    assert not list((ckpt.work_dir).glob("staging-*")), "staging folders must be removed"


def test_pre_download_reads_local_copies_from_work_dir(tmp_path, gcs_bucket):
    src = make_module(steps=2)
    c = CheckpointerConfig(work_dir=tmp_path / "work", pre_download=True).build()
    try:
        path = c.save(f"{gcs_bucket}/step2", src, {"step": 2})
        dst = fresh_module()
        c.load(path, dst)
    finally:
        c.close()
    assert_same_state(src, dst)
    cached = [p for p in (tmp_path / "work" / "download-cache").rglob("*") if p.is_file()]
    shard = _objects(path)["model_and_optim/__0_0.distcp"]
    assert shard.size in {p.stat().st_size for p in cached}, "the shard was not downloaded"


def test_async_save_commits_the_staged_state(ckpt, gcs_bucket):
    src = make_module(steps=2)
    expected = {k: v.clone() for k, v in src.model.state_dict().items()}
    future = ckpt.save_async(f"{gcs_bucket}/step2", src, {"step": 2})
    with torch.no_grad():  # training goes on right away; the checkpoint must not see it
        for p in src.model.parameters():
            p.add_(1.0)
    path = future.result()
    assert Checkpointer.latest_checkpoint(gcs_bucket) == path

    dst = fresh_module()
    ckpt.load(path, dst)
    for k, v in dst.model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_ephemeral_filter_on_gs(ckpt, gcs_bucket):
    module = make_module()
    ckpt.save(f"{gcs_bucket}/run/step1", module, {"step": 1})
    ckpt.save(f"{gcs_bucket}/run/step2", module, {"step": 2}, ephemeral=True)
    ckpt.save(f"{gcs_bucket}/run/step3", module, {"step": 3})
    run = f"{gcs_bucket}/run"
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [1, 2, 3]
    assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=True)] == [2]
    assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=False)] == [1, 3]
    assert Checkpointer.read_metadata(f"{run}/step2").ephemeral is True


def test_uncommitted_prefix_is_ignored_then_cleared_by_the_next_save(ckpt, gcs_bucket):
    run = f"{gcs_bucket}/run"
    ckpt.save(f"{run}/step1", make_module(), {"step": 1})
    # A crashed save of step 2: objects, but no commit record.
    from trainckpt.storage import resolve

    storage, _ = resolve(run)
    storage.write_bytes(f"{run}/step2/model_and_optim/__7_0.distcp", b"half a shard")
    storage.write_bytes(f"{run}/step2/train/rank0.pt", b"stale")

    assert not Checkpointer.dir_is_checkpoint(f"{run}/step2")
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [1]
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step1"

    src = make_module(seed=5)
    ckpt.save(f"{run}/step2", src, {"step": 2})
    names = set(_objects(f"{run}/step2"))
    assert "model_and_optim/__7_0.distcp" not in names, "the stale shard must be cleared"
    dst = fresh_module()
    assert ckpt.load(f"{run}/step2", dst) == {"step": 2}
    assert_same_state(src, dst)


def test_committed_prefix_refused_without_save_overwrite(tmp_path, gcs_bucket):
    target = f"{gcs_bucket}/step4"
    first = make_module(seed=1)
    c = CheckpointerConfig(work_dir=tmp_path / "w1").build()
    c.save(target, first, {"step": 4})
    with pytest.raises(CheckpointExistsError, match="save_overwrite"):
        c.save(target, make_module(seed=2), {"step": 4})
    c.close()
    dst = fresh_module()
    CheckpointerConfig(work_dir=tmp_path / "w2").build().load(target, dst)
    assert_same_state(first, dst)  # the refused save changed nothing

    second = make_module(seed=2)
    c2 = CheckpointerConfig(work_dir=tmp_path / "w3", save_overwrite=True).build()
    c2.save(target, second, {"step": 4})
    dst2 = fresh_module()
    c2.load(target, dst2)
    c2.close()
    assert_same_state(second, dst2)


def test_manifest_crc32c_equals_what_gcs_computed(ckpt, gcs_bucket):
    path = ckpt.save(f"{gcs_bucket}/step9", make_module(), {"step": 9})
    objects = _objects(path)
    manifest = CheckpointManifest.from_json(objects[".manifest.json"].download_as_bytes(), "m")
    assert set(manifest.files) == set(objects) - {".manifest.json", ".metadata.json"}
    assert any(name.endswith(".distcp") for name in manifest.files)
    for name, entry in manifest.files.items():
        assert entry.crc32c == crc32c_from_gcs(objects[name].crc32c), name
        assert entry.size == objects[name].size, name
    record = json.loads(objects[".metadata.json"].download_as_bytes())
    assert set(record) == {"ephemeral", "version"}


def test_missing_url_raises_file_not_found_naming_it(ckpt, gcs_bucket):
    missing = f"{gcs_bucket}/nothing/step5"
    with pytest.raises(FileNotFoundError, match="nothing/step5"):
        ckpt.load(missing, fresh_module())
    with pytest.raises(CheckpointNotFoundError, match="nothing/step5"):
        Checkpointer.read_metadata(missing)
    with pytest.raises(FileNotFoundError, match="nothing"):
        Checkpointer.latest_checkpoint(f"{gcs_bucket}/nothing")
    assert not Checkpointer.contains_checkpoint(f"{gcs_bucket}/nothing")


def test_files_upload_while_the_rest_are_still_written(tmp_path, gcs_bucket):
    """Object stores: a file is uploaded as soon as it is written, not after the last one."""
    from trainckpt.core.commit import SaveRequest, save_checkpoint, wait_for
    from trainckpt.storage import resolve
    from trainckpt.storage.checksums import FileEntry, crc32c_bytes

    storage, target = resolve(f"{gcs_bucket}/run/step1")
    first_seen_before_second_written = []

    def write(folder: Path, durable: bool, on_file) -> dict[str, FileEntry]:
        entries = {}
        for rel in ("train/rank0.pt", "model_and_optim/__0_0.distcp"):
            data = rel.encode() * 1000
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            (folder / rel).write_bytes(data)
            entries[rel] = FileEntry(size=len(data), crc32c=crc32c_bytes(data))
            on_file(rel)
            if rel.startswith("train/"):  # before writing the next file, the first is up
                first_seen_before_second_written.append(
                    wait_for(lambda r=rel: storage.exists(storage.join(target, r)), timeout=30)
                )
        return entries

    req = SaveRequest(storage, target, 1, False, False, None, 30.0, tmp_path / "work")
    assert save_checkpoint(req, write) == target
    assert first_seen_before_second_written == [True]
    assert Checkpointer.latest_checkpoint(f"{gcs_bucket}/run") == target
