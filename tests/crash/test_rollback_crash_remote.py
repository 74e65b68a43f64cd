"""SIGKILL a rolled-back run at each point of the replacement of an abandoned step on gs://
(fake-gcs-server) and s3:// (moto), both on 127.0.0.1: the old files are copied aside to
`step2-replaced/` before they are deleted, so at every moment the old folder or the new
checkpoint of the step exists whole, no finder reports the abandoned one or the copy aside,
and a restarted run finishes the replacement and leaves no copy behind."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from support.crash_worker import (
    Launcher,
    finish,
    new_module,
    rollback_run,
    start_on_gcs,
    start_on_s3,
)

from trainckpt import Checkpointer, CheckpointerConfig
from trainckpt.format.records import CheckpointManifest
from trainckpt.format.verify import check_crcs
from trainckpt.storage import resolve

pytestmark = pytest.mark.slow


def _whole(folder: str) -> bool:
    """Every file `folder`'s manifest lists is there with its CRC32C (commit record or not)."""
    storage, path = resolve(folder)
    manifest = CheckpointManifest.model_validate(
        json.loads(storage.read_bytes(storage.join(path, ".manifest.json")))
    )
    return not check_crcs(storage, path, sorted(manifest.files.items()))


def _files(folder: str) -> set[str]:
    storage, path = resolve(folder)
    return set(storage.list_files(path))


def _trajectory(path: str, work: Path) -> str:
    ckpt = CheckpointerConfig(work_dir=work).build()
    try:
        state = ckpt.load(path, new_module())
    finally:
        ckpt.close()
    assert state is not None
    return str(state.get("trajectory", "old"))


def _steps(url: str) -> list[int]:
    return [s for s, _ in Checkpointer.find_checkpoints(url)]


def _replace_with_kills(
    launcher: Launcher, tmp_path: Path, url: str, env: dict[str, Any], points: list[str]
) -> None:
    """Roll back to step 1 and get killed at each of `points` in turn while the save of step 2
    replaces the abandoned one (each run starts over from step 1); then resume from what the
    finders report and finish."""
    work = str(tmp_path / "work")
    step2, aside = f"{url}/step2", f"{url}/step2-replaced"
    for point in points:
        proc, _ = launcher.start(
            url, work, 1, 2, fault=point, fault_step=2, target=rollback_run, env=env
        )
        assert finish(proc) == -signal.SIGKILL, f"the fault point '{point}' was not reached"
        if point == "copying-aside":  # the old one untouched; an incomplete copy beside it
            assert _steps(url) == [1]
            assert ".abandoned.json" in _files(step2) and _whole(step2)
            assert ".abandoned.json" not in _files(aside)
        elif point == "replacing":  # the old one whole aside and gone from its prefix
            assert _steps(url) == [1]
            assert _files(step2) <= {".claim"}
            assert ".abandoned.json" in _files(aside) and _whole(aside)
        else:  # "replaced": the new one committed, the old one still whole aside
            assert _steps(url) == [1, 2]
            assert _whole(aside) and ".metadata.json" not in _files(aside)

    # A run resuming from the newest step reported saves the rest (step 3 replaces the
    # abandoned one); a copy aside left by a kill is gone by the end of the run.
    resume = _steps(url)[-1]
    proc, _ = launcher.start(url, work, resume, 3, target=rollback_run, env=env)
    assert finish(proc) == 0
    assert _steps(url) == [1, 2, 3]
    assert [_trajectory(f"{url}/step{s}", tmp_path / "check") for s in (2, 3)] == ["new", "new"]
    storage, path = resolve(url)
    assert storage.list_dir(path).dirs == ["step1", "step2", "step3"]


def _first_run(launcher: Launcher, tmp_path: Path, start: Any, url: str, server: str) -> None:
    proc, _ = start(launcher, tmp_path, url, server, 3, "sync", keep=None)
    assert finish(proc) == 0
    assert _steps(url) == [1, 2, 3]


def test_kills_while_replacing_an_abandoned_step_on_gcs(launcher, gcs_server, gcs_bucket, tmp_path):
    url = f"{gcs_bucket}/run"
    _first_run(launcher, tmp_path, start_on_gcs, url, gcs_server.url)
    env = {"STORAGE_EMULATOR_HOST": gcs_server.url, "NO_GCE_CHECK": "true"}
    _replace_with_kills(launcher, tmp_path, url, env, ["copying-aside", "replacing", "replaced"])


def test_kill_while_replacing_an_abandoned_step_on_s3(launcher, s3_server, s3_bucket, tmp_path):
    url = f"{s3_bucket}/run"
    _first_run(launcher, tmp_path, start_on_s3, url, s3_server.url)
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")}
    env["AWS_ENDPOINT_URL_S3"] = s3_server.url
    _replace_with_kills(launcher, tmp_path, url, env, ["replacing"])
