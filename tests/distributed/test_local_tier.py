"""The node-local tier over 4 gloo ranks on 2 simulated nodes: each "node" is its own folder
bind-mounted at the same path in each rank's mount namespace (`support.multiproc.fork_ranks`).
Every restore is compared bit for bit (a digest of the loaded module's state) with what that
rank saved at that step."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support.local_tier_worker import expected_digest
from support.multiproc import fork_ranks, need_mount_namespaces, run_ranks

from trainckpt.local.layout import scan
from trainckpt.testing.faults import ENV_VAR

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _nodes() -> None:
    """Every test here simulates nodes with mount namespaces: skipped without them, failed on
    CI (`need_mount_namespaces`)."""
    need_mount_namespaces()


WORKER = "support.local_tier_worker"
WORLD = 4


class Job:
    """Nodes (disks `node0`, `node1`, ...) and the local path each rank sees its node's disk at."""

    def __init__(self, tmp: Path, nodes: int = 2) -> None:
        self.tmp = tmp
        self.local = tmp / "local"
        self.disks = [tmp / f"node{n}" for n in range(nodes)]
        for d in (self.local, *self.disks):
            d.mkdir()
        self.runs = 0

    def run(
        self,
        scenario: str,
        *args: str,
        node_of: Callable[[int], int] = lambda r: r // 2,
        env: Callable[[int], dict[str, str]] | None = None,
        world: int = WORLD,
    ) -> list[tuple[int, dict | None]]:
        self.runs += 1

        return fork_ranks(
            WORKER,
            scenario,
            world,
            self.tmp / f"run{self.runs}",
            str(self.local),
            *args,
            disk=lambda r: (self.disks[node_of(r)], self.local),
            env=lambda r: {
                "LOCAL_WORLD_SIZE": "2",
                "LOCAL_RANK": str(r % 2),
                **(env(r) if env else {}),
            },
            timeout=180,
        )

    def log(self, rank: int) -> str:
        return (self.tmp / f"run{self.runs}" / f"rank{rank}.log").read_text()

    def parts(self, node: int, step: int, owner: int) -> list[Path]:
        return sorted(self.disks[node].glob(f"step{step}/*/rank{owner}"))


def _ok(results: list[tuple[int, dict | None]]) -> list[dict]:
    for code, res in results:
        assert code == 0 and res is not None and res["ok"], res
    return [res for _code, res in results]  # type: ignore[misc]


def _save(job: Job, steps: str, mode: str = "sync", **run: Any) -> list[dict[str, str]]:
    return [r["digests"] for r in _ok(job.run("local_save", steps, "0", mode, **run))]


def _assert_restored(results: list[dict], saved: list[dict[str, str]], step: int) -> None:
    for rank, res in enumerate(results):
        assert res["latest"] == step and res["step"] == step, res
        assert res["digest"] == saved[rank][str(step)], f"rank {rank}: not bit-exact"
        assert res["trainer"] == {"step": step, "rank": rank}


def test_save_then_wipe_one_node_restores_every_rank_bit_exact(tmp_path: Path):
    job = Job(tmp_path)
    saved = _save(job, "1,2", "async")  # parameters overwritten while each save runs
    for node in (0, 1):  # every part and a replica of it on the other node
        assert all(len(job.parts(node, 2, owner)) == 1 for owner in range(WORLD))
    shutil.rmtree(job.disks[1])
    job.disks[1].mkdir()
    _assert_restored(_ok(job.run("local_restore")), saved, 2)
    assert "received rank 2's part from rank 0" in job.log(2)


def test_parts_in_pieces_replicate_in_pieces_and_restore_bit_exact(tmp_path: Path):
    """Every part's module file cut into 3 pieces: each replica holds the same pieces (each
    CRC32C-checked against the owner's record). With a piece of rank 0's own copy cut short
    (the log names it) and rank 2's own copy gone, both receive their part from the replica
    on the other node, and every rank restores bit-exact."""
    job = Job(tmp_path)
    pieces = {"env": lambda r: {"LOCAL_PIECES": "3"}}
    saved = _save(job, "1", **pieces)
    want = {"module.0.pt", "module.1.pt", "module.2.pt", "train.pt", "part.json"}
    for node in (0, 1):
        for owner in range(WORLD):
            (part,) = job.parts(node, 1, owner)
            assert {p.name for p in part.iterdir()} == want, part
    (own,) = job.parts(0, 1, 0)
    _damage(own / "module.1.pt", "truncate")
    shutil.rmtree(job.parts(1, 1, 2)[0])
    _assert_restored(_ok(job.run("local_restore", **pieces)), saved, 1)
    assert "module.1.pt" in job.log(0)
    assert "received rank 0's part from rank 2" in job.log(0)
    assert "received rank 2's part from rank 0" in job.log(2)


def test_three_copies_one_rank_apart_survive_the_loss_of_two_nodes(tmp_path: Path):
    """replication_factor=3 with replication_jump=1 (not the default: 2 ranks per node), four
    nodes of one rank: rank R's part lies on the disks of ranks R, R+1 and R+2 (mod 4) and
    nowhere else; wiping two nodes leaves a copy of every part, and every rank restores
    bit-exact."""
    job = Job(tmp_path, nodes=4)
    run: dict[str, Any] = {
        "node_of": lambda r: r,
        "env": lambda r: {"LOCAL_RF": "3", "LOCAL_JUMP": "1"},
    }
    saved = _save(job, "1", **run)
    for owner in range(WORLD):
        held = {n for n in range(4) if job.parts(n, 1, owner)}
        assert held == {owner, (owner + 1) % 4, (owner + 2) % 4}, (owner, held)
    for node in (0, 1):
        shutil.rmtree(job.disks[node])
        job.disks[node].mkdir()
    _assert_restored(_ok(job.run("local_restore", **run)), saved, 1)
    assert "received rank 0's part from rank 2" in job.log(0)


def test_ranks_permuted_across_nodes_find_their_parts_by_rank(tmp_path: Path):
    job = Job(tmp_path)
    saved = _save(job, "1")
    shutil.rmtree(next(iter(job.parts(0, 1, 0))))  # node 0 also lost rank 0's own copy
    results = _ok(job.run("local_restore", node_of=lambda r: 1 - r // 2))
    _assert_restored(results, saved, 1)


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "flip":
        path.write_bytes(data[:1000] + bytes([data[1000] ^ 0x01]) + data[1001:])
    elif how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.write_bytes(b"")


@pytest.mark.parametrize("how", ["flip", "truncate", "empty"])
def test_a_damaged_copy_is_logged_and_the_other_copy_used(tmp_path: Path, how: str):
    job = Job(tmp_path)
    saved = _save(job, "1")
    (own,) = job.parts(0, 1, 0)
    _damage(own / "module.pt", how)
    _assert_restored(_ok(job.run("local_restore")), saved, 1)
    assert "module.pt" in job.log(0)
    assert "received rank 0's part from rank 2" in job.log(0)


def test_a_part_with_no_intact_copy_falls_back_to_the_older_step(tmp_path: Path):
    job = Job(tmp_path)
    saved = _save(job, "1,2")
    for node in (0, 1):
        (copy,) = job.parts(node, 2, 1)
        _damage(copy / "train.pt", "flip" if node else "truncate")
    _assert_restored_step = _ok(job.run("local_restore"))
    for rank, res in enumerate(_assert_restored_step):
        assert res["step"] == 1 and res["digest"] == saved[rank]["1"], res
    assert "no intact copy left of the parts of ranks [1]" in job.log(0)


@pytest.mark.parametrize(
    ("point", "killed", "survives", "mode"),
    [
        ("local-writing", (1,), 2, "sync"),
        ("local-writing-pieces", (1,), 2, "sync"),
        ("local-replicating", (2,), 2, "async"),
        ("local-between-phases", (0, 1, 2, 3), 2, "sync"),
        ("local-cleanup", (0,), 3, "sync"),
    ],
)
def test_rank_killed_at_a_named_point_never_restores_a_torn_step(
    tmp_path: Path, point: str, killed: tuple[int, ...], survives: int, mode: str
):
    """`local-writing-pieces`: `local-writing` with every module file in 4 pieces, so the
    kill comes while the pieces' flushes run and before any record."""
    pieces = point.endswith("-pieces")
    _kill_then_restart(
        Job(tmp_path), point.removesuffix("-pieces"), killed, survives, mode, pieces=pieces
    )


@pytest.mark.parametrize(
    ("killed", "kept"),
    [
        # markers of ranks 0 (parts 0, 2), 2 (2, 0) and 3 (3, 1): every part
        ((1,), ({3, 4}, {3, 4})),
        # all of node 0: markers of ranks 2 (2, 0) and 3 (3, 1) on node 1: every part; node 0's
        # unmarked copies of step 3 are leftovers there, so node 0 keeps steps 2 and 4
        ((0, 1), ({2, 4}, {3, 4})),
    ],
)
def test_a_step_whose_surviving_markers_cover_every_part_counts_though_its_save_failed(
    tmp_path: Path, killed: tuple[int, ...], kept: tuple[set[int], set[int]]
):
    """Ranks die between the phases of step 3: phase 1 was agreed (every part and replica
    durable and CRC-checked), the survivors write their markers and their save fails (a peer
    is gone). The surviving markers cover every part, so step 3 counts and is restored
    (docs/local-tier.md: what survives what). Markers that do not cover every part never count:
    `test_two_crashed_attempts_at_one_step_are_never_combined`."""
    _kill_then_restart(Job(tmp_path), "local-between-phases", killed, 3, "async", kept)


def _kill_then_restart(
    job: Job,
    point: str,
    killed: tuple[int, ...],
    survives: int,
    mode: str,
    kept: tuple[set[int], set[int]] | None = None,
    pieces: bool = False,
) -> None:
    """Save steps 1, 2, 3 with the ranks `killed` SIGKILLed at `point` of step 3's save; the
    restart restores step `survives` bit-exact on every rank, then saves step 4, deleting the
    crashed attempt's leftovers and nothing else: each disk keeps the steps `kept` (default:
    `survives` and 4)."""
    results = job.run(
        "local_save",
        "1,2,3",
        "0",
        mode,
        env=lambda r: {
            **({"LOCAL_FAULT": point} if r in killed else {}),
            **({"LOCAL_PIECES": "4"} if pieces else {}),
        },
    )
    for r, (code, res) in enumerate(results):
        if r in killed:
            assert code == -signal.SIGKILL, f"'{point}' was not reached: {results}"
        else:  # the survivors of a kill before the commit failed; after it (cleanup) not
            assert code == 0 and res is not None and res["ok"] == (point == "local-cleanup"), res
    restarted = _ok(job.run("local_restore", "4"))
    for r, res in enumerate(restarted):
        assert res["step"] == survives and res["digest"] == expected_digest(r, survives), res
        assert res["latest_after"] == 4
    for disk, steps in zip(job.disks, kept or ({survives, 4},) * 2, strict=True):
        assert scan(disk)[1] == [], scan(disk)[1]  # the crashed attempt's leftovers are gone
        assert sorted(int(d.name[4:]) for d in disk.glob("step*")) == sorted(steps)


def test_a_restore_killed_while_receiving_leaves_nothing_that_counts(tmp_path: Path):
    """Node 1 is wiped; rank 2 receives its part from rank 0 into a private file (no name)
    and is SIGKILLed after the first chunk, before the copy was checked. The torn copy dies
    with the process: nothing of it is left, the restart receives the part again and restores
    bit-exact; no copy is left after a restore."""
    job = Job(tmp_path)
    saved = _save(job, "1")
    shutil.rmtree(job.disks[1])
    job.disks[1].mkdir()
    results = job.run(
        "local_restore", env=lambda r: {ENV_VAR: "local-replicating"} if r == 2 else {}
    )
    assert results[2][0] == -signal.SIGKILL, results
    assert list(job.disks[1].glob("**/*.tmp")) == []
    _assert_restored(_ok(job.run("local_restore")), saved, 1)
    assert "received rank 2's part from rank 0" in job.log(2)
    assert list(job.disks[1].glob("**/*.tmp")) == []


def test_two_crashed_attempts_at_one_step_are_never_combined(tmp_path: Path):
    """Attempt 1 at step 2 commits only the parts of ranks 0 and 2 (ranks 1 and 3 die between
    the phases), attempt 2 (another state) only those of ranks 1 and 3: together they cover
    every rank, alone neither does. The restart must restore step 1."""
    job = Job(tmp_path)
    _save(job, "1")
    for attempt, killed in ((1, (1, 3)), (2, (0, 2))):
        results = job.run(
            "local_save",
            "2",
            str(attempt),
            env=lambda r, k=killed: {"LOCAL_FAULT": "local-between-phases"} if r in k else {},
        )
        assert [code for code, _ in results].count(-signal.SIGKILL) == 2, results
        markers = sorted(p.name for d in job.disks for p in d.glob("step2/*/commit.*"))
        assert markers, "the surviving ranks wrote their commit markers"
    assert len({p.parent.name for d in job.disks for p in d.glob("step2/*/commit.*")}) == 2
    for r, res in enumerate(_ok(job.run("local_restore"))):
        assert res["latest"] == 1 and res["step"] == 1, res
        assert res["digest"] == expected_digest(r, 1)


def test_another_world_size_is_refused_with_a_clear_log_line(tmp_path: Path):
    job = Job(tmp_path)
    _save(job, "1")
    results = _ok(job.run("local_restore", world=2, node_of=lambda r: 0))
    assert all(res["latest"] is None and res["step"] is None for res in results)
    assert "saved by 4 ranks; this job has 2 ranks" in job.log(0)


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(f"{field}:"))


def _restore_with_peak_memory(rank: int, world: int, folder: str) -> dict:
    """Save a ~115 MB part per rank, delete rank 0's own copy, and restore on both ranks.
    Returns the peak resident memory of this rank process during the restore above what it
    held before: the kernel's own high-water mark (`VmHWM`, reset by `clear_refs` just before
    the restore), so no peak is missed. It counts every page: anonymous memory and the mapped
    pages of the private copy being loaded. (`resource.getrusage`'s `ru_maxrss` is the same
    counter but cannot be reset, and the save before already peaked higher.)"""
    import gc

    import torch.distributed as dist
    from support.models import assert_same_state, make_module

    from trainckpt import CheckpointerConfig

    module = make_module(seed=rank, steps=1, width=1536)
    local = Path(folder, f"node{rank}")  # each rank its own disk
    ckpt = CheckpointerConfig(
        local_dir=local, replication_jump=1, work_dir=f"{folder}/w{rank}"
    ).build()
    ckpt.save_local(1, module, {"rank": rank}).result()
    (own,) = local.glob(f"step1/*/rank{rank}")
    part = sum(f.stat().st_size for f in own.glob("*.pt"))
    if rank == 0:
        shutil.rmtree(own)
    into = make_module(seed=99, steps=1, width=1536)  # other values, moments allocated
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # the peak starts again from here
    base = _status_bytes("VmRSS")
    assert ckpt.load_local(1, into) == {"rank": rank}
    peak = _status_bytes("VmHWM")
    assert_same_state(into, module)
    ckpt.close()
    return {"part": part, "extra": peak - base, "own_left": own.exists()}


def test_a_restore_holds_no_whole_part_in_memory(tmp_path: Path):
    """Rank 0 receives its part from rank 1, rank 1 reads its own: each copies the part into a
    private file on its own disk and loads the module from that file's mapped pages, so the
    restore's peak above the module it loads into is those pages (reclaimable page cache,
    one part) plus the transfer's two 16 MiB buffers. Holding the part in memory on top of
    that would exceed the bound (the in-memory restore held it about twice)."""
    results = run_ranks(_restore_with_peak_memory, 2, str(tmp_path))
    assert results[0]["own_left"] is False  # rank 0's part can only have come from rank 1
    for rank, res in enumerate(results):
        assert res["part"] > 100e6
        assert res["extra"] < 1.5 * res["part"], f"rank {rank}: {res}"
