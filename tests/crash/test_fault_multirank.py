"""Two real ranks (gloo on 127.0.0.1) save together; one of them is SIGKILLed in the middle of a
save. The survivor must fail with `RankFailedError` naming the lost peer (not hang, not commit);
every checkpoint the finders report loads exactly; two restarted ranks complete the run."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.crash_worker import (
    Launcher,
    check_checkpoints,
    finish,
    read_outcome,
    run_recorded,
    tmp_folders,
)
from support.ports import free_port

pytestmark = pytest.mark.slow

WORLD = 2


def _run_ranks(
    launcher: Launcher, folder: Path, last: int, mode: str, fault: str = "", fault_rank: int = -1
) -> list[int]:
    """Start WORLD ranks of one run; return their exit codes in rank order. The exception
    that ends rank R is in `folder.parent / f"outcome{R}.json"` (`read_outcome`)."""
    port = str(free_port())
    procs = []
    for rank in range(WORLD):
        env = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(WORLD),
        }
        kw = {"fault": fault, "fault_step": 3} if rank == fault_rank else {}
        work = str(folder.parent / f"work{rank}")
        outcome = folder.parent / f"outcome{rank}.json"
        outcome.unlink(missing_ok=True)
        procs.append(
            launcher.start(
                str(folder),
                work,
                last,
                mode,
                env=env,
                target=run_recorded,
                outcome=str(outcome),
                **kw,
            )  # fmt: skip
        )
    # (keep each `ready` event referenced until its process has started: it is a semaphore)
    return [finish(proc) for proc, _ready in procs]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize(
    ("point", "rank"),
    [("writing-shards", 1), ("before-manifest", 0)],
    ids=["rank1-dies-writing-shards", "rank0-dies-before-manifest"],
)
def test_one_rank_killed_mid_save(launcher, tmp_path, point, rank, mode):
    folder = tmp_path / "run"
    codes = _run_ranks(launcher, folder, 4, mode, fault=point, fault_rank=rank)
    assert codes[rank] == -signal.SIGKILL, f"exit codes {codes}: '{point}' was not reached"
    assert codes[1 - rank] == 1, f"exit codes {codes}: the surviving rank must fail, not commit"
    _assert_lost_its_peer(read_outcome(tmp_path / f"outcome{1 - rank}.json"))
    assert check_checkpoints(folder) == [1, 2]

    assert _run_ranks(launcher, folder, 5, mode) == [0, 0]
    assert check_checkpoints(folder) == [4, 5]
    assert sorted(p.name for p in (folder / "step5" / "train").iterdir()) == [
        "rank0.pt",
        "rank1.pt",
    ]
    assert not list(tmp_folders(folder))


def _assert_lost_its_peer(chain: list[dict] | None) -> None:
    """The survivor ended with a trainckpt error raised from a collective of the save that
    lost its peer: gloo sees the killed rank's connection close, so this comes at once, before
    `collective_timeout` (which is for a peer that hangs), as `RankFailedError`."""
    assert chain, "the surviving rank exited with code 1 but recorded no exception"
    assert chain[0]["checkpoint_error"], chain[0]
    lost = [e for e in chain if e["type"] == "RankFailedError"]
    assert lost, chain
    assert "lost contact with another rank" in lost[0]["message"], lost[0]
    assert any(
        word in lost[0]["message"] for word in ("Connection reset by peer", "Connection closed")
    ), lost[0]
