"""Checkpointer on gs:// against a real fake-gcs-server, what only GCS does (what every back end
does alike: `contract/test_checkpointer_contract.py`): pre-download through cached-path, the
manifest's CRC32C against the one GCS computed, uploads that start while files are written, and
one manifest download per load (counted at a proxy)."""

from __future__ import annotations

import json

import pytest
from google.cloud import storage as gcs
from support.models import assert_same_state, fresh_module, make_module
from support.servers import FakeGCS, fault_proxy

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointManifest,
)
from trainckpt.storage.checksums import crc32c_from_gcs


def _objects(url: str) -> dict[str, gcs.Blob]:
    """Every object under `url` (a gs:// folder), read with the plain SDK, by relative name."""
    bucket, _, prefix = url[len("gs://") :].partition("/")
    return {
        b.name[len(prefix) + 1 :]: b for b in gcs.Client().list_blobs(bucket, prefix=prefix + "/")
    }


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


def test_files_upload_while_the_rest_are_still_written(tmp_path, gcs_bucket):
    """Object stores: a file is uploaded as soon as it is written, not after the last one."""
    from trainckpt.core.commit import SaveRequest, save_checkpoint, wait_for
    from trainckpt.core.rank_write import WriteTarget
    from trainckpt.storage import resolve
    from trainckpt.storage.checksums import FileEntry, crc32c_bytes

    storage, target = resolve(f"{gcs_bucket}/run/step1")
    first_seen_before_second_written = []

    class TwoFiles:
        def write(self, to: WriteTarget) -> dict[str, FileEntry]:
            entries = {}
            for rel in ("train/rank0.pt", "model_and_optim/__0_0.distcp"):
                data = rel.encode() * 1000
                (to.folder / rel).parent.mkdir(parents=True, exist_ok=True)
                (to.folder / rel).write_bytes(data)
                entries[rel] = FileEntry(size=len(data), crc32c=crc32c_bytes(data))
                assert to.on_file is not None
                to.on_file(rel)
                if rel.startswith("train/"):  # before writing the next file, the first is up
                    first_seen_before_second_written.append(
                        wait_for(lambda r=rel: storage.exists(storage.join(target, r)), timeout=30)
                    )
            return entries

    req = SaveRequest(storage, target, 1, False, False, None, 30.0, tmp_path / "work")
    assert save_checkpoint(req, TwoFiles()) == target
    assert first_seen_before_second_written == [True]
    assert Checkpointer.latest_checkpoint(f"{gcs_bucket}/run") == target


@pytest.mark.parametrize("level", ["size", "full", "none"])
def test_a_load_reads_the_manifest_once(tmp_path, gcs_server: FakeGCS, gcs_bucket, level):
    """The manifest is read once per load, by rank 0, for both the check of the files and the
    saved world size (counted at a real HTTP proxy in front of fake-gcs-server)."""
    c = CheckpointerConfig(work_dir=tmp_path / "work", verify_on_load=level).build()
    try:
        src = make_module(steps=2)
        path = c.save(f"{gcs_bucket}/run/step2", src, {"step": 2})
        with fault_proxy(gcs_server) as proxy:
            dst = fresh_module()
            loaded = c.load(path, dst)
            assert proxy.downloads(".manifest.json") == 1, [
                r for r in proxy.log if "manifest" in r[1]
            ]
            # the proxy saw the load: its trainer state and shards came through it
            assert proxy.count("GET", "rank0.pt") >= 1
    finally:
        c.close()
    assert loaded == {"step": 2}
    assert_same_state(src, dst)
