"""Checkpointer against a real S3-compatible server (moto on 127.0.0.1): save, save_async, load,
finders, verify, deletion and crash recovery on s3://, with one and with two real ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support import TESTS
from support.crash_worker import CLAIM_LEASE
from support.models import assert_same_state, fresh_module, make_module
from support.s3_server import MotoS3, S3Proxy

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointExistsError,
    CheckpointManifest,
    CheckpointNotFoundError,
)
from trainckpt.storage import resolve
from trainckpt.storage.checksums import crc32c_bytes


@pytest.fixture
def ckpt(tmp_path: Path) -> Iterator[Checkpointer]:
    c = CheckpointerConfig(work_dir=tmp_path / "work", retry_deadline=30).build()
    yield c
    c.close()


def _objects(s3: MotoS3, url: str) -> dict[str, bytes]:
    """Every object under `url` (an s3:// folder), read with a plain boto3 client."""
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    client = s3.client()
    out = {}
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
    for page in pages:
        for obj in page.get("Contents", []):
            body = client.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
            out[obj["Key"][len(prefix) + 1 :]] = body
    return out


def test_round_trip_with_manifest_crc32c_and_verify(
    ckpt: Checkpointer, s3_bucket: str, s3_server: MotoS3
) -> None:
    src = make_module(steps=3)
    state = {"step": 3, "rng": torch.get_rng_state(), "data": {"epoch": 1}}
    path = ckpt.save(f"{s3_bucket}/run/step3/", src, state)
    assert path == f"{s3_bucket}/run/step3"
    assert Checkpointer.dir_is_checkpoint(path)

    objects = _objects(s3_server, path)
    manifest = CheckpointManifest.from_json(objects[".manifest.json"], "manifest")
    assert set(manifest.files) == set(objects) - {".manifest.json", ".metadata.json"}
    assert any(name.endswith(".distcp") for name in manifest.files)
    for name, entry in manifest.files.items():  # what S3 holds is what the manifest vouches for
        assert entry.size == len(objects[name]) and entry.crc32c == crc32c_bytes(objects[name])
    assert set(json.loads(objects[".metadata.json"])) == {"ephemeral", "version"}
    report = Checkpointer.verify(path, deep=True)
    assert report.ok and report.files_checked == len(manifest.files), str(report)

    dst = fresh_module()
    loaded = ckpt.load(path, dst)
    assert_same_state(src, dst)
    assert loaded is not None and loaded["step"] == 3 and loaded["data"] == {"epoch": 1}
    assert torch.equal(loaded["rng"], state["rng"])
    assert not list(ckpt.work_dir.glob("staging-*")), "staging folders must be removed"


def test_pre_download_reads_local_copies_through_cached_path(
    tmp_path: Path, s3_bucket: str, s3_proxy: S3Proxy
) -> None:
    """With `pre_download`, shards come down whole through cached-path (which finds the server
    by `AWS_ENDPOINT_URL_S3` too) into `work_dir`, instead of as byte ranges."""
    src = make_module(steps=2)
    c = CheckpointerConfig(work_dir=tmp_path / "work", pre_download=True).build()
    try:
        path = c.save(f"{s3_bucket}/step2", src, {"step": 2})
        s3_proxy.requests.clear()
        dst = fresh_module()
        c.load(path, dst)
    finally:
        c.close()
    assert_same_state(src, dst)
    shard = resolve(path)[0].size(f"{path}/model_and_optim/__0_0.distcp")
    cached = [p for p in (tmp_path / "work" / "download-cache").rglob("*") if p.is_file()]
    assert shard in {p.stat().st_size for p in cached}, "the shard was not downloaded"
    assert any(r.path.endswith("__0_0.distcp") for r in s3_proxy.ops("GetObject"))


def test_deep_verify_finds_a_corrupt_object_that_sizes_miss(
    ckpt: Checkpointer, s3_bucket: str, s3_server: MotoS3
) -> None:
    path = ckpt.save(f"{s3_bucket}/step1", make_module(), {"step": 1})
    bucket, _, prefix = path.removeprefix("s3://").partition("/")
    key = f"{prefix}/model_and_optim/__0_0.distcp"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size: bit rot
    client.put_object(Bucket=bucket, Key=key, Body=bytes(data))

    assert Checkpointer.verify(path).ok  # sizes only
    report = Checkpointer.verify(path, deep=True)
    assert not report.ok
    assert any("__0_0.distcp" in p for p in report.problems), report.problems


def test_async_save_commits_the_staged_state(ckpt: Checkpointer, s3_bucket: str) -> None:
    src = make_module(steps=2)
    expected = {k: v.clone() for k, v in src.model.state_dict().items()}
    future = ckpt.save_async(f"{s3_bucket}/step2", src, {"step": 2})
    with torch.no_grad():  # training goes on right away; the checkpoint must not see it
        for p in src.model.parameters():
            p.add_(1.0)
    path = future.result()
    assert Checkpointer.latest_checkpoint(s3_bucket) == path
    dst = fresh_module()
    ckpt.load(path, dst)
    for k, v in dst.model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_ephemeral_filter(ckpt: Checkpointer, s3_bucket: str) -> None:
    module = make_module()
    run = f"{s3_bucket}/run"
    ckpt.save(f"{run}/step1", module, {"step": 1})
    ckpt.save(f"{run}/step2", module, {"step": 2}, ephemeral=True)
    ckpt.save(f"{run}/step3", module, {"step": 3})
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [1, 2, 3]
    assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=True)] == [2]
    assert [s for s, _ in Checkpointer.find_checkpoints(run, ephemeral=False)] == [1, 3]
    assert Checkpointer.read_metadata(f"{run}/step2").ephemeral is True


def test_retention_deletes_superseded_ephemeral_checkpoints_on_s3(
    ckpt: Checkpointer, s3_bucket: str, s3_server: MotoS3
) -> None:
    from trainckpt import CheckpointPolicy
    from trainckpt.retention.remover import Remover

    run = f"{s3_bucket}/run"
    module = make_module()
    ckpt.save(f"{run}/step1", module, {"step": 1})
    ckpt.save(f"{run}/step2", module, {"step": 2}, ephemeral=True)
    ckpt.save(f"{run}/step3", module, {"step": 3}, ephemeral=True)
    remover = Remover(run, CheckpointPolicy(remove="ephemeral_only"))
    try:
        assert remover.run_round() == [f"{run}/step2"]
    finally:
        remover.close()
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [1, 3]
    assert _objects(s3_server, f"{run}/step2") == {}


def test_committed_prefix_refused_without_save_overwrite(tmp_path: Path, s3_bucket: str) -> None:
    target = f"{s3_bucket}/step4"
    first = make_module(seed=1)
    c = CheckpointerConfig(work_dir=tmp_path / "w1").build()
    c.save(target, first, {"step": 4})
    with pytest.raises(CheckpointExistsError, match="save_overwrite"):
        c.save(target, make_module(seed=2), {"step": 4})
    dst = fresh_module()
    c.load(target, dst)
    c.close()
    assert_same_state(first, dst)  # the refused save changed nothing

    second = make_module(seed=2)
    c2 = CheckpointerConfig(work_dir=tmp_path / "w2", save_overwrite=True).build()
    c2.save(target, second, {"step": 4})
    dst2 = fresh_module()
    c2.load(target, dst2)
    c2.close()
    assert_same_state(second, dst2)


def test_crashed_save_is_ignored_then_cleared_by_the_next_save(
    ckpt: Checkpointer, s3_bucket: str, s3_server: MotoS3, tmp_path: Path
) -> None:
    """A real process saving to S3 is SIGKILLed after every shard is uploaded and before the
    commit record: its objects are no checkpoint, and the next save of that step clears them."""
    run = f"{s3_bucket}/run"
    ckpt.save(f"{run}/step1", make_module(), {"step": 1})
    # The crashed save wrote one more (stale) object than the next save will.
    storage, _ = resolve(run)
    storage.write_bytes(f"{run}/step2/model_and_optim/__7_0.distcp", b"half a shard")
    script = textwrap.dedent(
        f"""
        from support.models import make_module
        from trainckpt import CheckpointerConfig
        ckpt = CheckpointerConfig(
            work_dir={str(tmp_path / "crash")!r}, claim_lease={CLAIM_LEASE!r}
        ).build()
        ckpt.save({run + "/step2"!r}, make_module(seed=9), {{"step": 2}})
        """
    )
    env = {**os.environ, "TRAINCKPT_FAULT_POINT": "before-commit-record", "PYTHONPATH": str(TESTS)}
    proc = subprocess.run([sys.executable, "-c", script], env=env, timeout=300)
    assert proc.returncode == -9, "the saving process was meant to die by SIGKILL"

    left = _objects(s3_server, f"{run}/step2")
    assert ".manifest.json" in left and ".metadata.json" not in left
    assert any(name.endswith(".distcp") for name in left)
    assert not Checkpointer.dir_is_checkpoint(f"{run}/step2")
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [1]
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step1"

    src = make_module(seed=5)
    ckpt.save(f"{run}/step2", src, {"step": 2})
    assert "model_and_optim/__7_0.distcp" not in _objects(s3_server, f"{run}/step2")
    assert Checkpointer.verify(f"{run}/step2").ok  # nothing unexpected is left over
    dst = fresh_module()
    assert ckpt.load(f"{run}/step2", dst) == {"step": 2}
    assert_same_state(src, dst)


def test_finders_and_delete_past_1000_keys(
    ckpt: Checkpointer, s3_bucket: str, s3_server: MotoS3, s3_proxy: S3Proxy
) -> None:
    """1,003 step folders (listing pages hold 1,000) and a checkpoint of 1,200 objects."""
    bucket = s3_bucket.removeprefix("s3://")
    record = b'{"ephemeral": false, "version": "0.1.0"}'
    # step1000 ... step2002: the newest ones are only on the listing's second page.
    s3_server.put_many(bucket, [f"run/step{s}/.metadata.json" for s in range(1000, 2003)], record)
    assert Checkpointer.latest_checkpoint(f"{s3_bucket}/run") == f"{s3_bucket}/run/step2002"

    path = ckpt.save(f"{s3_bucket}/big/step5", make_module(), {"step": 5})
    prefix = "big/step5/extra"
    s3_server.put_many(bucket, [f"{prefix}/part{i:04d}" for i in range(1200)], b"z")
    s3_proxy.requests.clear()
    Checkpointer.delete(path)

    deletes = s3_proxy.ops("DeleteObjects")
    assert deletes[0].body.count(b"<Key>") == 1 and b".metadata.json" in deletes[0].body
    assert all(r.body.count(b"<Key>") <= 1000 for r in deletes)
    assert sum(r.body.count(b"<Key>") for r in deletes[1:]) >= 1200
    assert _objects(s3_server, path) == {}
    with pytest.raises(CheckpointNotFoundError):
        Checkpointer.read_metadata(path)


def _two_ranks_save_and_load(rank: int, world: int, folder: str, work: str) -> dict:
    from support.models import assert_same_state, fresh_module, make_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainckpt import Checkpointer, CheckpointerConfig, ModelAndOptim

    ckpt = CheckpointerConfig(work_dir=f"{work}/rank{rank}", collective_timeout=120).build()
    src = make_module(seed=7)
    src = ModelAndOptim(DDP(src.model), src.optim)
    path = ckpt.save_async(f"{folder}/step1", src, {"rank": rank}).result()
    dst = fresh_module()
    dst = ModelAndOptim(DDP(dst.model), dst.optim)
    state = ckpt.load(path, dst)
    reference = make_module(seed=7)
    assert_same_state(ModelAndOptim(DDP(reference.model), reference.optim), dst)
    ckpt.close()
    return {"state": state, "found": list(Checkpointer.find_checkpoints(folder))}


@pytest.mark.slow
def test_two_ranks_save_async_and_load(s3_bucket: str, tmp_path: Path) -> None:
    from support.multiproc import run_ranks

    folder = f"{s3_bucket}/ddp"
    results = run_ranks(_two_ranks_save_and_load, 2, folder, str(tmp_path))
    assert [r["state"] for r in results] == [{"rank": 0}, {"rank": 1}]
    assert results[0]["found"] == [(1, f"{folder}/step1")]
    manifest = CheckpointManifest.from_json(
        resolve(folder)[0].read_bytes(f"{folder}/step1/.manifest.json"), "manifest"
    )
    assert manifest.world_size == 2
    assert {"train/rank0.pt", "train/rank1.pt"} <= set(manifest.files)
    assert Checkpointer.verify(f"{folder}/step1", deep=True).ok
