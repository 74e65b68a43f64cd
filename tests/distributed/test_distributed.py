"""Many ranks, simulated nodes: unshared folders, failing ranks, async saves beside training."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.multiproc import can_unshare_mounts, launch_ranks, on_disk

pytestmark = pytest.mark.slow


def _committed(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/.metadata.json"))


@pytest.mark.skipif(not can_unshare_mounts(), reason="needs mount namespaces (unshare, root)")
def test_unshared_folder_is_refused_on_every_rank_before_writing(tmp_path: Path):
    shared, node1 = tmp_path / "shared", tmp_path / "node1-disk"
    shared.mkdir()
    node1.mkdir()

    def node_of(rank: int) -> list[str]:
        # Rank 1 is "another node": the same path is its own local disk.
        if rank == 0:
            return []
        return on_disk(node1, shared)

    results = launch_ranks("not_shared", 2, tmp_path / "out", str(shared), prefix=node_of)
    for code, res in results:
        assert code == 0 and res is not None and not res["ok"], res
        assert "SharedFolderError" in res["type"] or "RankFailedError" in res["type"], res
        assert "shared" in res["message"]
    assert "gs://" in results[1][1]["message"]  # the rank that cannot see says what to do
    # Nothing was written on either "node": no shards, no leftovers that look like data.
    assert list(shared.iterdir()) == []
    assert not list(node1.rglob("*.distcp")) and not list(node1.rglob("rank*.pt"))


def test_rank_exception_fails_every_rank_and_commits_nothing(tmp_path: Path):
    results = launch_ranks(
        "rank_fails", 2, tmp_path / "out", str(tmp_path / "ckpt"), "raise", "sync"
    )
    (code0, res0), (code1, res1) = results
    assert res1["type"] == "RuntimeError" and "host memory" in res1["message"]
    assert res0["type"] == "RankFailedError" and "rank 1" in res0["message"]
    assert "host memory" in res0["message"]
    assert _committed(tmp_path / "ckpt") == []


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_killed_rank_makes_the_others_fail_not_hang(tmp_path: Path, mode: str):
    results = launch_ranks(
        "rank_fails", 2, tmp_path / "out", str(tmp_path / "ckpt"), "kill", mode, timeout=180
    )
    (code0, res0), (code1, _res1) = results
    assert code1 == -9  # SIGKILL
    assert res0 is not None and not res0["ok"]
    assert res0["type"] == "RankFailedError" and "another rank" in res0["message"], res0
    assert _committed(tmp_path / "ckpt") == []
    assert not (tmp_path / "ckpt" / "step1").exists()


@pytest.mark.parametrize("point", ["writing-shards", "after-shards"])
def test_rank_killed_mid_write_commits_nothing(tmp_path: Path, point: str):
    results = launch_ranks(
        "rank_fails",
        2,
        tmp_path / "out",
        str(tmp_path / "ckpt"),
        "fault-point",
        "sync",
        env=lambda rank: {"TRAINCKPT_FAULT_POINT": point} if rank == 1 else {},
        timeout=180,
    )
    (code0, res0), (code1, _res1) = results
    assert code1 == -9
    assert res0 is not None and not res0["ok"], res0
    assert _committed(tmp_path / "ckpt") == []


def test_async_saves_beside_training_collectives_do_not_deadlock(tmp_path: Path):
    results = launch_ranks("async_interleaved", 2, tmp_path / "out", str(tmp_path / "ckpt"))
    for code, res in results:
        assert code == 0 and res["ok"], res
        assert res["steps"] == [2, 4, 6]
    assert len(_committed(tmp_path / "ckpt")) == 3
