"""A process that ends while `save_async` is writing, without `close()`: the save commits before
the process ends (a bounded wait), or an ERROR line names the checkpoint that was lost.

Each case is a real process (`exit_worker.py`, or two ranks of `rank_worker.py`) that ends by
`sys.exit`, an uncaught exception, or SIGTERM (handled by the trainer, or Python's default).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support import SUPPORT
from support.exit_worker import HOWS
from support.models import assert_same_state, fresh_module, make_module
from support.multiproc import launch_ranks

from trainckpt import Checkpointer, CheckpointerConfig

WORKER = SUPPORT / "exit_worker.py"
EXIT_CODE = {"exit": 0, "raise": 1, "sigterm-handler": 143, "sigterm-default": -signal.SIGTERM}


def _end_mid_save(
    folder: str, how: str, exit_timeout: float, work_dir: Path, writer: str = "thread"
) -> tuple[int, str]:
    """Run the worker; return its exit code and log."""
    done = subprocess.run(
        [sys.executable, str(WORKER), folder, how, str(exit_timeout), str(work_dir), writer],
        capture_output=True,
        text=True,
        timeout=240,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    return done.returncode, done.stdout + done.stderr


def _assert_committed_and_exact(path: str, work_dir: Path) -> None:
    report = Checkpointer.verify(path, deep=True)
    assert report.ok and not report.unverifiable, report
    ckpt = CheckpointerConfig(work_dir=work_dir).build()
    try:
        dst = fresh_module()
        assert ckpt.load(path, dst) == {"step": 1}
        assert_same_state(make_module(), dst)
    finally:
        ckpt.close()


@pytest.fixture(params=["local", "gs"])
def folder(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gcs_bucket")


@pytest.mark.parametrize("how", HOWS)
def test_save_in_flight_at_exit_commits(folder: str, how: str, tmp_path: Path) -> None:
    code, log = _end_mid_save(folder, how, 300, tmp_path / "work")
    path = f"{folder}/step1"
    assert code == EXIT_CODE[how], log
    assert "save in flight at the end: True" in log, log  # the exit hook had work to do
    assert f"waiting up to 300s for the save of '{path}' to commit" in log, log
    _assert_committed_and_exact(path, tmp_path / "check")


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_save_in_flight_at_exit_commits_through_the_writer_process(
    how: str, tmp_path: Path
) -> None:
    folder = str(tmp_path / "run")
    code, log = _end_mid_save(folder, how, 300, tmp_path / "work", "process")
    assert code == EXIT_CODE[how], log
    assert "save in flight at the end: True" in log, log
    assert "started the writer process" in log, log
    _assert_committed_and_exact(f"{folder}/step1", tmp_path / "check")


@pytest.mark.parametrize("how", ["exit", "sigterm-default"])
def test_save_not_waited_for_is_named_in_an_error(folder: str, how: str, tmp_path: Path) -> None:
    """With `exit_timeout=0` the save is abandoned: an ERROR names it. At exit the process
    ends once the save stops, and a last line says whether it committed after all (it may have
    been past its last task) or is lost; SIGTERM ends the process at once."""
    code, log = _end_mid_save(folder, how, 0, tmp_path / "work")
    path = f"{folder}/step1"
    assert code == EXIT_CODE[how], log
    errors = [line for line in log.splitlines() if line.startswith("ERROR") and path in line]
    assert errors, log
    if Checkpointer.dir_is_checkpoint(path):
        assert how == "exit" and f"the abandoned save of '{path}' committed after all" in log
        _assert_committed_and_exact(path, tmp_path / "check")
    elif how == "exit":
        assert f"the abandoned save of '{path}' is lost" in log, log


def test_two_ranks_exit_mid_save_commit(tmp_path: Path) -> None:
    folder = str(tmp_path / "run")
    results = launch_ranks("exit_mid_save", 2, tmp_path / "out", folder, "exit", "300")
    logs = [(tmp_path / "out" / f"rank{r}.log").read_text() for r in range(2)]
    assert [code for code, _ in results] == [0, 0], logs
    assert all("save in flight at the end: True" in log for log in logs), logs
    _assert_committed_and_exact(f"{folder}/step1", tmp_path / "check")


def test_two_ranks_exit_with_a_dead_peer_ends_and_names_the_save(tmp_path: Path) -> None:
    """Rank 1 is killed mid-save while rank 0 exits: rank 0 must not wait forever for it (the
    save fails on the collective timeout at the latest) and must say the save was lost."""
    folder = str(tmp_path / "run")
    results = launch_ranks(
        "exit_mid_save",
        2,
        tmp_path / "out",
        folder,
        "exit",
        "300",
        env=lambda rank: {"TRAINCKPT_FAULT_POINT": "writing-shards"} if rank == 1 else {},
        timeout=120,
    )
    log0 = (tmp_path / "out" / "rank0.log").read_text()
    assert [code for code, _ in results] == [0, -signal.SIGKILL], log0
    path = f"{folder}/step1"
    assert any(
        line.startswith("ERROR") and f"the save of '{path}' failed and is lost" in line
        for line in log0.splitlines()
    ), log0
    assert not Checkpointer.dir_is_checkpoint(path)


TP_WORKER = SUPPORT / "tp_exit_worker.py"


def test_two_rank_tensor_parallel_runs_exit_cleanly_without_close(tmp_path: Path) -> None:
    """OLMo-core's style: a tensor-parallel save and load, the checkpointer never closed, the
    job's groups destroyed (or not) before the interpreter exits. Every run must exit 0, and
    the checkpointer's own gloo group must be released before the interpreter finalizes (at
    finalization its worker threads abort the process now and then: "terminate called without
    an active exception"). Run several times: the abort is a race."""
    for run in range(6):
        teardown = "destroy" if run % 2 == 0 else "keep"
        out = tmp_path / f"out{run}"
        results = launch_ranks("-", 2, out, str(tmp_path / f"run{run}"), teardown, worker=TP_WORKER)
        logs = [(out / f"rank{r}.log").read_text() for r in range(2)]
        assert [code for code, _ in results] == [0, 0], (run, teardown, logs)
        for log in logs:
            assert "loaded exactly" in log, (run, log)
            assert "own group alive at the last exit hook: False" in log, (run, teardown, log)
