"""Saves of one step racing each other, and saves racing `trainckpt prune` and another job's
retention in the same local folder (issue 13, items 3 and 4; docs/design.md §8).

Racers are real processes forked from crash_worker's forkserver. The promise, checked in every
trial: at most one save is told it committed; what it committed passes a deep verify and loads
exactly that save's state; every other save fails at once (not after `fs_timeout`) with a
`CheckpointError` that says why; nothing is left behind (no `-tmp`, no lock file).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import shutil
import signal
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.crash_worker import (
    check_checkpoint,
    check_checkpoints,
    finish,
    reference,
    run_cli,
    save_steps,
    tmp_folders,
    trainer_state,
)

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointPolicy,
    CorruptCheckpointError,
)
from trainckpt.cli.main import main as cli_main
from trainckpt.core.step_lock import StepLock
from trainckpt.retention.remover import Remover
from trainckpt.testing.faults import on_fault_point

pytestmark = pytest.mark.slow

TRIALS = 10


@pytest.fixture
def checker(tmp_path: Path) -> Iterator[Checkpointer]:
    ckpt = CheckpointerConfig(work_dir=tmp_path / "check").build()
    yield ckpt
    ckpt.close()


def _outcomes(out: Path) -> list[dict[str, Any]]:
    return json.loads(out.read_text())


def _leftovers(folder: Path) -> list[str]:
    """Working folders and lock files in a save folder: none may outlive the saves."""
    return sorted(n for n in os.listdir(folder) if n.endswith("-tmp") or n.endswith(".lock"))


def _assert_names_the_holder(message: str, save_of: Path, pid: int, window: tuple) -> None:
    """A refusal names the save that holds the step: its target, pid, host and the time it
    took the step, which lies in `window` (the UTC times, to the second, around the race)."""
    holder = re.search(r"save of '(.+)', by pid (\d+) on (\S+) since (\S+)\)?", message)
    assert holder is not None, message
    assert holder[1] == str(save_of) and int(holder[2]) == pid, message
    assert holder[3] == socket.gethostname(), message
    since = _dt.datetime.fromisoformat(holder[4].rstrip(").;,"))
    assert window[0] <= since <= window[1], (message, window)


def _utc_second() -> _dt.datetime:
    return _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0)


def test_two_processes_save_one_step(launcher, tmp_path, checker):
    """Two processes save different states (1 and 3 shard files) to the same step at once.
    The loser is refused while the winner holds the step (so at once, not after waiting for
    `fs_timeout`), by an error naming the winner's pid, host and start, or, when the winner
    already committed, by `CheckpointExistsError`."""
    for trial in range(TRIALS):
        folder = tmp_path / f"trial{trial}"
        start = launcher.ctx.Barrier(2)
        racers = {}
        began = _utc_second()
        for variant, shards in ((1, 1), (2, 3)):
            out = tmp_path / f"trial{trial}-racer{variant}.json"
            work = str(tmp_path / f"work{variant}")
            proc = launcher.call(
                save_steps, str(folder), work, [variant], str(out), shards, None, start, "step7"
            )
            racers[variant] = (proc, out)
        for proc, _out in racers.values():
            assert finish(proc) == 0
        window = (began, _utc_second())
        results = {v: _outcomes(out)[0] for v, (_proc, out) in racers.items()}

        committed = [v for v, r in results.items() if "committed" in r]
        assert len(committed) == 1, f"trial {trial}: {results}"
        winner = committed[0]
        loser = results[3 - winner]
        assert loser["checkpoint_error"], f"trial {trial}: {loser}"
        if loser["error"] == "ConcurrentSaveError":
            tmp = folder / "step7-tmp"
            assert f"another save of step7 is in progress in '{tmp}'" in loser["message"]
            winner_pid = racers[winner][0].pid
            _assert_names_the_holder(loser["message"], folder / "step7", winner_pid, window)
        else:
            assert loser["error"] == "CheckpointExistsError", f"trial {trial}: {loser}"
            assert f"'{folder / 'step7'}' is already a committed checkpoint" in loser["message"]

        check_checkpoint(results[winner]["committed"], winner, tmp_path / "check")
        assert sorted(os.listdir(folder)) == ["step7"], f"trial {trial}"


def test_second_save_prune_and_retention_leave_a_running_save_alone(launcher, tmp_path, checker):
    """Deterministic: while a save of step 5 holds its claim (in this process), another
    process's save of step 5 is refused at once, `trainckpt prune` in another process skips
    the live `step5-tmp`, and retention in this process keeps it; the save then commits."""
    folder = tmp_path / "run"
    checker.save(str(folder / "step9"), reference(9), trainer_state(9))  # newer, committed
    tmp = folder / "step5-tmp"
    seen: dict[str, Any] = {}

    def beside_the_save() -> None:
        out = tmp_path / "racer.json"
        proc = launcher.call(save_steps, str(folder), str(tmp_path / "w"), [5], str(out))
        assert finish(proc) == 0
        seen["racer"] = _outcomes(out)[0]
        out = tmp_path / "prune.json"
        assert finish(launcher.call(run_cli, ["prune", str(folder), "-k", "1"], str(out))) == 0
        seen["prune"] = json.loads(out.read_text())
        policy = CheckpointPolicy(remove="all_non_permanent")
        seen["retention"] = Remover(str(folder), policy).run_round()
        seen["tmp files"] = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*"))

    began = _utc_second()
    with on_fault_point("after-shards", beside_the_save):
        path = checker.save(str(folder / "step5"), reference(5), trainer_state(5))

    racer = seen["racer"]
    assert racer["error"] == "ConcurrentSaveError", racer
    assert f"another save of step5 is in progress in '{tmp}'" in racer["message"]
    _assert_names_the_holder(
        racer["message"], folder / "step5", os.getpid(), (began, _utc_second())
    )
    assert seen["prune"]["code"] == 0
    assert "keep          step5-tmp" in seen["prune"]["output"], seen["prune"]["output"]
    assert seen["retention"] == []
    assert "train/rank0.pt" in seen["tmp files"]
    check_checkpoint(path, 5, tmp_path / "check")
    check_checkpoint(str(folder / "step9"), 9, tmp_path / "check")
    assert _leftovers(folder) == []


def _delete_one_shard(tmp: Path) -> None:
    next(tmp.glob("model_and_optim/*.distcp")).unlink()


def _delete_folder(tmp: Path) -> None:
    shutil.rmtree(tmp)


@pytest.mark.parametrize(
    ("point", "damage", "error"),
    [
        ("after-shards", _delete_one_shard, CorruptCheckpointError),
        ("after-shards", _delete_folder, CheckpointNotFoundError),
        ("before-manifest", _delete_folder, CheckpointNotFoundError),
        ("before-commit-record", _delete_folder, CheckpointNotFoundError),
    ],
)
def test_tmp_damaged_under_a_save_commits_nothing(
    tmp_path: Path,
    checker: Checkpointer,
    point: str,
    damage: Callable[[Path], None],
    error: type[CheckpointError],
):
    """A working folder damaged by something that ignores the claim (a person's `rm -rf`)
    fails the save: nothing is committed and the folder is never recreated."""
    folder = tmp_path / "run"
    tmp = folder / "step5-tmp"
    with on_fault_point(point, lambda: damage(tmp)), pytest.raises(error) as info:
        checker.save(str(folder / "step5"), reference(5), trainer_state(5))
    assert str(folder / "step5") in str(info.value)
    assert not (folder / "step5").exists()
    assert not list(Checkpointer.find_checkpoints(folder))
    assert _leftovers(folder) == []
    # the next save of that step is unaffected
    path = checker.save(str(folder / "step5"), reference(5), trainer_state(5))
    check_checkpoint(path, 5, tmp_path / "check")


def _loop_beside(proc: Any, round_: Callable[[], None]) -> int:
    """Run `round_` again and again until `proc` ends; return how many rounds ran."""
    rounds = 0
    while proc.is_alive():
        round_()
        rounds += 1
    return rounds


STEPS = [1, 2, 3, 4, 5, 6]


def test_saves_beside_a_prune_loop(launcher, tmp_path, capsys):
    """`trainckpt prune` loops while another process saves six steps: every save commits, and
    every checkpoint is complete and exactly its step's state."""
    folder, out = tmp_path / "run", tmp_path / "saves.json"
    ready = launcher.ctx.Event()
    proc = launcher.call(save_steps, str(folder), str(tmp_path / "w"), STEPS, str(out), 2, ready)
    assert ready.wait(120), "the first save did not finish"
    codes: list[int] = []
    _loop_beside(proc, lambda: codes.append(cli_main(["prune", str(folder), "-k", "100"])))
    assert finish(proc) == 0
    assert codes and set(codes) == {0}, capsys.readouterr().err
    assert [o.get("committed") for o in _outcomes(out)] == [str(folder / f"step{s}") for s in STEPS]
    assert check_checkpoints(folder) == STEPS
    assert _leftovers(folder) == []


def test_saves_beside_another_jobs_retention(launcher, tmp_path, checker):
    """Another job's retention (`remove: all_non_permanent`, which deletes leftovers older than
    the newest checkpoint, here that job's step 1000) loops while six steps are saved."""
    folder, out = tmp_path / "run", tmp_path / "saves.json"
    checker.save(str(folder / "step1000"), reference(8), trainer_state(8))  # its state: any
    remover = Remover(str(folder), CheckpointPolicy(remove="all_non_permanent"))
    deleted: list[str] = []
    proc = launcher.call(save_steps, str(folder), str(tmp_path / "w"), STEPS, str(out))
    _loop_beside(proc, lambda: deleted.extend(remover.run_round()))
    assert finish(proc) == 0
    assert [o.get("committed") for o in _outcomes(out)] == [str(folder / f"step{s}") for s in STEPS]
    assert not [d for d in deleted if not d.endswith("-tmp")], deleted
    for step in STEPS:
        check_checkpoint(str(folder / f"step{step}"), step, tmp_path / "check")
    check_checkpoint(str(folder / "step1000"), 8, tmp_path / "check")
    assert _leftovers(folder) == []


def test_crash_leftover_is_cleared_by_prune_and_by_the_next_save(launcher, tmp_path):
    """A save SIGKILLed while holding its claim leaves `-tmp` and the lock file; the kernel
    dropped the lock, so prune deletes the `-tmp` and a restarted run saves that step again."""
    folder = tmp_path / "run"
    proc, _ready = launcher.start(
        str(folder), str(tmp_path / "w"), 3, "sync", fault="before-rename", fault_step=3
    )
    assert finish(proc) == -signal.SIGKILL
    assert _leftovers(folder) == [".step3.lock", "step3-tmp"]
    assert cli_main(["prune", str(folder), "-k", "5"]) == 0
    assert _leftovers(folder) == []

    proc, _ready = launcher.start(
        str(folder), str(tmp_path / "w"), 5, "sync", fault="before-rename", fault_step=4
    )
    assert finish(proc) == -signal.SIGKILL
    assert [p.name for p in tmp_folders(folder)] == ["step4-tmp"]
    proc, _ready = launcher.start(str(folder), str(tmp_path / "w"), 5, "sync")
    assert finish(proc) == 0
    assert check_checkpoints(folder) == [4, 5]
    assert _leftovers(folder) == []


def test_prune_and_retention_keep_a_checkpoint_a_save_overwrite_is_replacing(tmp_path, checker):
    """While a save of step 1 holds the step lock (here: taken directly, as `save_overwrite`
    of a committed step1 holds it), neither prune nor retention deletes step1."""
    folder = tmp_path / "run"
    for step in (1, 2, 3):
        checker.save(str(folder / f"step{step}"), reference(step), trainer_state(step))
    lock = StepLock(folder / "step1", "save of step1 (test)")
    assert lock.take()
    try:
        assert cli_main(["prune", str(folder), "-k", "1"]) == 0
        policy = CheckpointPolicy(remove="all_non_permanent", max_checkpoints=1)
        assert Remover(str(folder), policy).run_round() == []  # step2 went with prune
    finally:
        lock.release()
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [1, 3]
    check_checkpoint(str(folder / "step1"), 1, tmp_path / "check")
