"""Checkpointer on s3:// against a real S3-compatible server (moto on 127.0.0.1), what only S3
does (what every back end does alike: `contract/test_checkpointer_contract.py`): pre-download
through cached-path, retention's deletes, a SIGKILLed save's leftovers, listings and deletes
past 1,000 keys, and two real ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import TESTS
from support.crash_worker import CLAIM_LEASE
from support.models import assert_same_state, fresh_module, make_module
from support.s3_server import MotoS3, S3Proxy

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointManifest,
    CheckpointNotFoundError,
)
from trainckpt.storage import resolve


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
    assert s3_server.objects(f"{run}/step2") == {}


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

    left = s3_server.objects(f"{run}/step2")
    assert ".manifest.json" in left and ".metadata.json" not in left
    assert any(name.endswith(".distcp") for name in left)
    assert not Checkpointer.dir_is_checkpoint(f"{run}/step2")
    assert [s for s, _ in Checkpointer.find_checkpoints(run)] == [1]
    assert Checkpointer.latest_checkpoint(run) == f"{run}/step1"

    src = make_module(seed=5)
    ckpt.save(f"{run}/step2", src, {"step": 2})
    assert "model_and_optim/__7_0.distcp" not in s3_server.objects(f"{run}/step2")
    assert Checkpointer.verify(f"{run}/step2").ok  # nothing unexpected is left over
    dst = fresh_module()
    assert ckpt.load(f"{run}/step2", dst) == {"step": 2}
    assert_same_state(src, dst)


def test_object_store_manifests_name_their_attempt_under_format_2(
    ckpt: Checkpointer, s3_bucket: str, s3_server: MotoS3, tmp_path: Path
) -> None:
    """trainckpt 0.1 forbids unknown manifest fields: a manifest naming its save attempt says
    format 2, so 0.1 asks for an upgrade instead of calling the checkpoint damaged; local
    saves, which name no attempt, stay format 1 and readable by 0.1."""
    import json

    remote = ckpt.save(f"{s3_bucket}/run/step1", make_module(), {"step": 1})
    local = ckpt.save(tmp_path / "run" / "step1", make_module(), {"step": 1})
    remote_raw = json.loads(s3_server.objects(remote)[".manifest.json"])
    local_raw = json.loads((Path(local) / ".manifest.json").read_bytes())
    assert remote_raw["format"] == 2 and len(remote_raw["attempt"]) == 32
    assert local_raw["format"] == 1 and "attempt" not in local_raw
    assert Checkpointer.verify(remote).ok and Checkpointer.verify(local).ok


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
    assert s3_server.objects(path) == {}
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
