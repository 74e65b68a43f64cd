"""Checkpointer.write_file into a committed checkpoint: the file joins the manifest, so the
checkpoint still verifies (OLMo-core's ConfigSaverCallback writes config.json into each)."""

from __future__ import annotations

import pytest
from support.models import make_module

from trainckpt import Checkpointer, CheckpointerConfig, CheckpointExistsError, ConfigurationError


@pytest.fixture(params=["local", "gs"])
def run_folder(request, tmp_path) -> str:
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gcs_bucket") + "/run"


def test_file_written_into_a_checkpoint_is_in_its_manifest(tmp_path, run_folder):
    ckpt = CheckpointerConfig(work_dir=tmp_path / "w").build()
    step = f"{run_folder}/step3"
    ckpt.save(step, make_module(seed=1), {"step": 3})
    ckpt.write_file(step, "config.json", '{"lr": 1}')
    ckpt.write_file(step, "extra/data_paths.txt", b"a.npy\n")
    report = Checkpointer.verify(step, deep=True)
    assert report.ok and not report.unverifiable, report.problems
    assert report.manifest is not None
    files = report.manifest.files
    assert {"config.json", "extra/data_paths.txt"} <= set(files)
    assert files["config.json"].size == len('{"lr": 1}')

    with pytest.raises(CheckpointExistsError):  # create-only without save_overwrite
        ckpt.write_file(step, "config.json", "{}")
    for bad in ("../escape.txt", "/abs.txt", ".manifest.json", ".metadata.json"):
        with pytest.raises(ConfigurationError):
            ckpt.write_file(step, bad, "x")
    assert Checkpointer.verify(step, deep=True).ok

    # Outside a checkpoint: only the file, no manifest, no checkpoint.
    ckpt.write_file(run_folder, "metrics.json", "{}")
    assert [s for s, _ in Checkpointer.find_checkpoints(run_folder)] == [3]
    ckpt.close()
    assert (
        not (tmp_path / "escape.txt").exists()
        and not (tmp_path / "run" / ".manifest.json").exists()
    )


def test_file_added_behind_the_checkpointers_back_still_fails_verification(tmp_path):
    ckpt = CheckpointerConfig(work_dir=tmp_path / "w").build()
    step = tmp_path / "run" / "step3"
    ckpt.save(step, make_module(seed=1), {"step": 3})
    (step / "config.json").write_text("{}")
    report = Checkpointer.verify(step)
    assert not report.ok and "config.json" in " ".join(report.problems)
    ckpt.close()
