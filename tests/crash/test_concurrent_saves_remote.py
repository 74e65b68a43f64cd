"""Concurrent saves of one step on gs:// and s3:// (fake-gcs-server and moto on 127.0.0.1).

Two independent processes save the same step at once with different states and different
numbers of shard files; a save is SIGKILLed and its stale claim is taken over, by one save or by
two racing ones; prune and another job's retention run beside saves. In every trial: at most
one save is told it committed, and it is what the step holds (a deep verify passes and the
checkpoint loads exactly that save's state); every other save fails with a clear
`CheckpointError` naming the step; no deletion removes a live save's objects.
"""

from __future__ import annotations

import os
import queue
import signal
import threading
from pathlib import Path
from typing import Any

import pytest
from support.crash_worker import (
    CLAIM_LEASE,
    JOIN_TIMEOUT,
    Launcher,
    check_checkpoint,
    delete_loop,
    finish,
    new_module,
    save_once,
    train_step,
    trainer_state,
)
from support.s3_server import _ENV as S3_ENV

from trainckpt import CheckpointerConfig, CheckpointExistsError, ConcurrentSaveError
from trainckpt.core.claim import Claim, acquire
from trainckpt.format.layout import CLAIM_FILE
from trainckpt.storage import Storage, resolve

pytestmark = pytest.mark.slow

LOSER_ERRORS = ("ConcurrentSaveError", "CheckpointExistsError")


@pytest.fixture(params=["gcs", "s3"])
def remote(request: pytest.FixtureRequest) -> tuple[str, dict[str, str]]:
    """(an empty bucket URL, the environment a forked process needs to reach its server)."""
    if request.param == "gcs":
        bucket: str = request.getfixturevalue("gcs_bucket")
        names = ["STORAGE_EMULATOR_HOST", "NO_GCE_CHECK"]
    else:
        bucket = request.getfixturevalue("s3_bucket")
        names = [*S3_ENV, "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"]
    return bucket, {k: os.environ[k] for k in names}


def _race(
    launcher: Launcher, url: str, env: dict[str, str], work: Path, savers: list[dict[str, Any]]
) -> list[tuple[int, str, str]]:
    """Start one process per entry of `savers` (keyword arguments of `save_once`), release
    them at once, and return each one's (steps, outcome, message)."""
    go, results = launcher.ctx.Event(), launcher.ctx.Queue()
    procs = []
    for i, kw in enumerate(savers):
        procs.append(
            launcher.start(
                url, str(work / f"p{i}"), env=env, go=go, results=results, **kw, target=save_once
            )
        )
    for _proc, ready in procs:
        assert ready.wait(JOIN_TIMEOUT), "a saving process did not start"
    go.set()
    codes = [finish(proc) for proc, _ in procs]
    out = []
    for _ in range(sum(1 for c in codes if c == 0)):
        out.append(results.get(timeout=JOIN_TIMEOUT))
    return out


def _one_committed(outcomes: list[tuple[int, str, str]], url: str, why: str) -> int:
    """Exactly one save was told it committed; every other one failed with a clear error
    naming `url`. Returns the committed save's number of trained steps."""
    committed = [steps for steps, outcome, _ in outcomes if outcome == "committed"]
    assert len(committed) == 1, f"{why}: {outcomes}"
    for _steps, outcome, message in outcomes:
        if outcome != "committed":
            assert outcome in LOSER_ERRORS, f"{why}: {outcome}: {message}"
            assert url in message, f"{why}: the error does not name the step: {message}"
    return committed[0]


def _assert_clean(url: str) -> None:
    storage, path = resolve(url)
    assert CLAIM_FILE not in storage.list_files(path), "the committed save left its claim"


def test_two_saves_of_one_step_at_once(launcher, remote, tmp_path):
    bucket, env = remote
    for trial in range(8):
        url = f"{bucket}/race{trial}/step7"
        outcomes = _race(
            launcher,
            url,
            env,
            tmp_path / f"t{trial}",
            [{"steps": 2, "threads": 1}, {"steps": 3, "threads": 4}],  # 1 vs 4 shard files
        )
        assert len(outcomes) == 2, f"trial {trial}: a process died: {outcomes}"
        winner = _one_committed(outcomes, url, f"trial {trial}")
        check_checkpoint(url, winner, tmp_path / "check")
        _assert_clean(url)


def _kill_a_save(launcher: Launcher, url: str, env: dict[str, str], work: Path) -> None:
    """A save of 4 shard files SIGKILLed after uploading everything and its manifest, before
    its commit record: it leaves its claim and its objects behind."""
    go, results = launcher.ctx.Event(), launcher.ctx.Queue()
    proc, ready = launcher.start(
        url,
        str(work / "killed"),
        steps=5,
        threads=4,
        env=env,
        go=go,
        results=results,
        fault="before-commit-record",
        target=save_once,
    )
    assert ready.wait(JOIN_TIMEOUT)
    go.set()
    assert finish(proc) == -signal.SIGKILL, "the save was not killed at its fault point"
    storage, path = resolve(url)
    left = storage.list_files(path)
    assert CLAIM_FILE in left and len(left) > 3, left


def test_stale_claim_of_a_killed_save_is_taken_over(launcher, remote, tmp_path):
    bucket, env = remote
    url = f"{bucket}/run/step4"
    _kill_a_save(launcher, url, env, tmp_path)
    outcomes = _race(launcher, url, env, tmp_path / "next", [{"steps": 2, "threads": 1}])
    assert outcomes == [(2, "committed", url)]
    check_checkpoint(url, 2, tmp_path / "check")  # none of the killed save's 4 shards is left
    _assert_clean(url)


def test_two_saves_racing_to_take_over_a_stale_claim(launcher, remote, tmp_path):
    bucket, env = remote
    for trial in range(3):
        url = f"{bucket}/takeover{trial}/step4"
        _kill_a_save(launcher, url, env, tmp_path / f"t{trial}")
        outcomes = _race(
            launcher,
            url,
            env,
            tmp_path / f"t{trial}",
            [{"steps": 2, "threads": 1}, {"steps": 3, "threads": 2}],
        )
        assert len(outcomes) == 2, f"trial {trial}: a process died: {outcomes}"
        winner = _one_committed(outcomes, url, f"trial {trial}")
        check_checkpoint(url, winner, tmp_path / "check")
        _assert_clean(url)


def _acquire_at_once(
    storage: Storage, dir: str, n: int
) -> tuple[list[Claim], list[ConcurrentSaveError]]:
    """`n` threads try to claim `dir` at the same moment; each winner renews its claim, as a
    save does. Returns the claims won and the errors of the others."""
    start = threading.Barrier(n)
    won: queue.Queue[Claim] = queue.Queue()
    lost: queue.Queue[ConcurrentSaveError] = queue.Queue()

    def newcomer() -> None:
        start.wait()
        try:
            claim = acquire(storage, dir, lease=5.0)
            claim.start_renewing()  # late newcomers see it alive
            won.put(claim)
        except ConcurrentSaveError as e:
            lost.put(e)

    threads = [threading.Thread(target=newcomer) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return list(won.queue), list(lost.queue)


def test_racing_takeovers_of_one_stale_claim_only_one_wins(remote):
    """Four threads find the same stale claim and try to take it over at the same moment
    (each a compare-and-swap on the version they watched): exactly one holds it."""
    bucket, _ = remote
    storage, _ = resolve(bucket)
    for trial in range(5):
        dir = f"{bucket}/threads{trial}/step1"
        stale = acquire(storage, dir, lease=0.3)  # never renewed: stale after 0.3 s
        won, lost = _acquire_at_once(storage, dir, 4)
        assert len(won) == 1 and len(lost) == 3, (trial, won, lost)
        holder = won[0]
        assert holder.attempt != stale.attempt
        with pytest.raises(ConcurrentSaveError, match="lost its claim"):
            stale.confirm()  # the crashed save, were it to wake up, could not commit
        holder.confirm()
        holder.release()


def test_live_claim_is_never_taken_over(remote):
    """A claim renewed by its holder makes every newcomer fail, saying a save is in
    progress, however long the newcomer watches it."""
    bucket, _ = remote
    storage, _ = resolve(bucket)
    dir = f"{bucket}/live/step1"
    holder = acquire(storage, dir, lease=1.0)
    holder.start_renewing()
    try:
        for _ in range(3):
            with pytest.raises(ConcurrentSaveError, match="is in progress") as info:
                acquire(storage, dir, lease=1.0)
            assert dir in str(info.value)
        holder.confirm()
    finally:
        holder.release()
    again = acquire(storage, dir, lease=1.0)  # released: free again, no waiting
    assert again.attempt != holder.attempt
    again.release()


@pytest.mark.parametrize("kind", ["prune", "retention"])
def test_deletions_beside_saves_never_remove_a_live_save(launcher, remote, tmp_path, kind):
    """Another job prunes (or runs retention on) the save folder in a loop while this
    process saves step after step: every save commits, complete, with its own state."""
    bucket, env = remote
    folder = f"{bucket}/run"
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", claim_lease=CLAIM_LEASE).build()
    module = new_module()
    # retention deletes leftovers older than the newest checkpoint: make every save older
    ckpt.save(f"{folder}/step1000", module, trainer_state(0))
    stop, results = launcher.ctx.Event(), launcher.ctx.Queue()
    proc, ready = launcher.start(folder, kind, env, stop, results, target=delete_loop)
    assert ready.wait(JOIN_TIMEOUT)
    try:
        for step in range(1, 7):
            train_step(module, step)
            path = ckpt.save(f"{folder}/step{step}", module, trainer_state(step))
            check_checkpoint(path, step, tmp_path / "check")
    finally:
        stop.set()
        ckpt.close()
        assert finish(proc) == 0
    assert results.get(timeout=JOIN_TIMEOUT) > 0, "the deletion loop never ran a round"


def test_claim_left_in_a_committed_checkpoint_is_harmless(remote, tmp_path):
    """A crash between the commit record and the claim's deletion leaves the claim in a
    committed checkpoint: verify ignores it, it loads, and another save of the step is refused
    as committed."""
    bucket, _ = remote
    url = f"{bucket}/run/step1"
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work", claim_lease=CLAIM_LEASE).build()
    module = new_module()
    train_step(module, 1)
    try:
        ckpt.save(url, module, trainer_state(1))
        storage, path = resolve(url)
        acquire(storage, path, lease=CLAIM_LEASE)  # never renewed nor released: a crash
        check_checkpoint(url, 1, tmp_path / "check")
        with pytest.raises(CheckpointExistsError, match="already a committed checkpoint"):
            ckpt.save(url, module, trainer_state(1))
    finally:
        ckpt.close()
