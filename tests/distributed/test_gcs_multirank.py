"""Two real ranks (gloo) saving to and loading from gs://, with `throttle_uploads`."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from support.multiproc import run_ranks
from support.servers import FakeGCS, fault_proxy

pytestmark = pytest.mark.slow


def _save_throttled_and_load(rank: int, world: int, url: str, work: str) -> dict:
    import torch
    from support.models import assert_same_state, fresh_module, make_module
    from torch.nn.parallel import DistributedDataParallel as DDP

    from trainckpt import Checkpointer, CheckpointerConfig, ModelAndOptim
    from trainckpt.storage import StorageOptions, storage_for

    config = CheckpointerConfig(
        work_dir=f"{work}/rank{rank}", throttle_uploads=True, save_thread_count=2
    )
    ckpt = config.build()
    # Record when this rank's real uploads run (CLOCK_MONOTONIC is shared by the processes).
    storage = storage_for(url, StorageOptions(thread_count=2, retry_deadline=config.retry_deadline))
    real_upload = storage.upload
    intervals: list[tuple[int, int]] = []

    def timed_upload(local: Path, location: str, *, overwrite: bool = True) -> None:
        start = time.monotonic_ns()
        real_upload(local, location, overwrite=overwrite)
        intervals.append((start, time.monotonic_ns()))

    storage.upload = timed_upload  # type: ignore[method-assign]

    src = make_module(seed=7)
    src = ModelAndOptim(DDP(src.model), src.optim)
    path = ckpt.save(f"{url}/step1", src, {"rank": rank, "rng": torch.get_rng_state()})

    dst = fresh_module()
    dst = ModelAndOptim(DDP(dst.model), dst.optim)
    trainer = ckpt.load(path, dst)
    reference = make_module(seed=7)
    assert_same_state(ModelAndOptim(DDP(reference.model), reference.optim), dst)
    found = [s for s, _ in Checkpointer.find_checkpoints(url)]
    ckpt.close()
    return {"intervals": intervals, "trainer_rank": trainer["rank"], "found": found}


def test_two_ranks_on_one_node_upload_in_turns(gcs_bucket: str, tmp_path: Path) -> None:
    url = f"{gcs_bucket}/run"
    results = run_ranks(_save_throttled_and_load, 2, url, str(tmp_path), timeout=240)
    for rank, res in enumerate(results):
        assert res["trainer_rank"] == rank
        assert res["found"] == [1]
        assert res["intervals"], f"rank {rank} uploaded nothing"
    # Both processes run on this host: rank 0 uploads in turn 0, rank 1 in turn 1, never both.
    rank0_end = max(end for _, end in results[0]["intervals"])
    rank1_start = min(start for start, _ in results[1]["intervals"])
    assert rank0_end <= rank1_start, "rank 1 started uploading before rank 0 had finished"

    from trainckpt import Checkpointer
    from trainckpt.storage import resolve

    storage, step1 = resolve(f"{url}/step1")
    files = storage.list_files(step1)
    assert {"train/rank0.pt", "train/rank1.pt", ".manifest.json", ".metadata.json"} <= set(files)
    assert Checkpointer.verify(step1, deep=True).ok


def _save_then_load_through(
    rank: int, world: int, url: str, work: str, server_url: str, proxy_url: str
) -> dict:
    """Save with both ranks straight to fake-gcs-server, then load through the proxy."""
    import os

    os.environ["STORAGE_EMULATOR_HOST"] = server_url
    from support.models import fresh_module, make_module

    from trainckpt import CheckpointerConfig
    from trainckpt.core import dist

    ckpt = CheckpointerConfig(work_dir=f"{work}/rank{rank}").build()
    path = ckpt.save(f"{url}/step1", make_module(seed=3), {"rank": rank})
    dist.barrier(ckpt.process_group)
    os.environ["STORAGE_EMULATOR_HOST"] = proxy_url  # the load goes through the proxy
    trainer = ckpt.load(path, fresh_module())
    ckpt.close()
    return {"trainer_rank": trainer["rank"]}


def test_a_two_rank_load_reads_the_manifest_once(
    gcs_server: FakeGCS, gcs_bucket: str, tmp_path: Path
) -> None:
    """One manifest read per job, not per rank: rank 0 reads it, the others get its copy."""
    with fault_proxy(gcs_server) as proxy:
        results = run_ranks(
            _save_then_load_through,
            2,
            f"{gcs_bucket}/run",
            str(tmp_path),
            gcs_server.url,
            proxy.url,
            timeout=240,
        )
        assert [r["trainer_rank"] for r in results] == [0, 1]  # each rank's own state
        assert proxy.downloads(".manifest.json") == 1, [r for r in proxy.log if "manifest" in r[1]]
        assert proxy.count("GET", "rank1.pt") >= 1  # the ranks did load through the proxy
