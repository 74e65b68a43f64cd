"""trainckpt as a drop-in for OLMo-core's checkpointer, under OLMo-core's REAL Trainer on CPU
(`olmo_trainer.py`: transformer, `TransformerTrainModule`, numpy data loader,
`CheckpointerCallback` with permanent and ephemeral saves). trainckpt's `Checkpointer` comes in
through `TrainerConfig(checkpointer=OLMoCheckpointerConfig())`, nothing else changed.

Reference for "bit-identical": an uninterrupted run with OLMo-core's own checkpointer.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from olmo_core.train import TrainerConfig
from olmo_core.train.checkpoint import Checkpointer as OLMoCheckpointer
from support import SUPPORT
from support.olmo_trainer import (
    STEPS,
    DirectTrainModule,
    Run,
    assert_identical,
    build_trainer,
    snapshot,
    train,
)

from trainckpt import (
    Checkpointer,
    CheckpointerConfig,
    ConfigurationError,
    OLMoCheckpointerConfig,
    UnsafeCheckpointError,
)

pytestmark = pytest.mark.slow

HELPER = SUPPORT / "olmo_trainer.py"
TORCHRUN = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The uninterrupted run (step 0 to 10) with OLMo-core's own checkpointer."""
    root = tmp_path_factory.mktemp("reference")
    return train(root, root / "run", Run("olmo"))


def committed_steps(folder: Path) -> list[int]:
    return [step for step, _ in Checkpointer.find_checkpoints(folder)]


def stop_and_resume(root: Path, writer: Run, resumer: Run) -> tuple[dict, Path]:
    """Train to step 7 with `writer` (the hard stop saves step 7), then resume to step 10 with
    `resumer` from the same save folder."""
    folder = root / "run"
    stopped = train(root, folder, Run(writer.checkpointer, writer.save_async, stop=7))
    assert stopped["step"] == 7
    return train(root, folder, resumer), folder


@pytest.mark.parametrize("save_async", [False, True], ids=["sync", "async"])
def test_stopped_and_resumed_run_is_bit_identical(tmp_path, reference, save_async):
    run = Run("trainckpt", save_async)
    final, folder = stop_and_resume(tmp_path, run, run)
    assert final["step"] == STEPS and final["tokens"] == reference["tokens"]
    assert_identical(reference, final)
    steps = committed_steps(folder)
    assert {0, 5, 7, 10} <= set(steps)
    for step in steps:  # every checkpoint the Trainer left has a manifest that checks out
        report = Checkpointer.verify(folder / f"step{step}", deep=True)
        assert report.ok and not report.unverifiable, report.problems
    if not save_async:  # async removals depend on timing (OLMo-core removes when none pending)
        assert steps == [0, 5, 7, 8, 10]  # what OLMo-core's own checkpointer leaves
    # ConfigSaverCallback wrote config.json into each checkpoint after its commit: recorded in
    # the manifest (so the resume above verified), and the config names trainckpt's class.
    manifest = json.loads((folder / "step7" / ".manifest.json").read_text())
    assert {"config.json", "data_paths.txt"} <= set(manifest["files"])
    config = json.loads((folder / "step7" / "config.json").read_text())
    assert (
        config["checkpointer"]["_CLASS_"]
        == "trainckpt.integrations.olmo_core.OLMoCheckpointerConfig"
    )


@pytest.mark.parametrize(
    "writer, resumer",
    [("trainckpt", "olmo"), ("olmo", "trainckpt")],
    ids=["ours-by-olmo", "olmo-by-ours"],
)
def test_each_resumes_the_others_checkpoints_bit_identical(tmp_path, reference, writer, resumer):
    final, folder = stop_and_resume(tmp_path, Run(writer), Run(resumer))
    assert_identical(reference, final)
    assert Checkpointer.verify(folder / "step7").unverifiable == (writer == "olmo")


def test_kill_during_async_save_then_resume(tmp_path, reference):
    """SIGKILL (trainckpt fault point) in the async save of step 6, while training goes on:
    the torn save is never reported, and the resumed run finishes bit-identical."""
    folder = tmp_path / "run"
    cmd = [sys.executable, str(HELPER), str(tmp_path), str(folder), "trainckpt", "--async"]
    proc = subprocess.run([*cmd, "--kill-at", "6"], env=_env(), capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr[-3000:]
    steps = committed_steps(folder)
    assert {0, 4, 5} <= set(steps) and max(steps) == 5  # step 6's save died before its commit
    assert Checkpointer.latest_checkpoint(folder).endswith("step5")
    assert OLMoCheckpointer.latest_checkpoint(str(folder)).endswith("step5")

    final = train(tmp_path, folder, Run("trainckpt", save_async=True))
    assert_identical(reference, final)
    # The torn step-6 folder is gone; a step 6 that remains is the resumed run's own ephemeral
    # save (async removals depend on timing), so every step left must check out in full.
    assert not list(folder.glob("*-tmp"))
    for step in committed_steps(folder):
        report = Checkpointer.verify(folder / f"step{step}", deep=True)
        assert report.ok and not report.unverifiable, (step, report.problems)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """Per rank: an uninterrupted torchrun run (2 gloo ranks, DDP), OLMo-core's checkpointer."""
    root = tmp_path_factory.mktemp("ddp-reference")
    _torchrun(root, root / "run", "olmo", "--out", str(root / "result"))
    return [torch.load(root / f"result.rank{r}.pt", weights_only=False) for r in (0, 1)]


@pytest.mark.parametrize("mode", ["--async", "--direct"])
def test_torchrun_two_ranks_ddp(tmp_path, ddp_reference, mode):
    """Two gloo ranks under torchrun with DDP: stop at 7 and resume with trainckpt (async saves;
    or sync saves of a direct-API module, each rank writing its own shards) equals the
    uninterrupted OLMo-core run, on each rank. OLMo-core's limits on CPU: DDP only (its FSDP/HSDP
    and the fused-MoE direct module need CUDA), and with async saves slower than a step its
    callback removes no ephemeral checkpoint until a step finds none pending (so which
    ephemeral ones remain is not asserted)."""
    run = tmp_path / "run"
    _torchrun(tmp_path, run, "trainckpt", mode, "--stop", "7")
    assert 7 in committed_steps(run)
    _torchrun(tmp_path, run, "trainckpt", mode, "--out", str(tmp_path / "result"))
    for rank in (0, 1):
        got = torch.load(tmp_path / f"result.rank{rank}.pt", weights_only=False)
        assert got["step"] == STEPS
        assert_identical(ddp_reference[rank], got)
    for step in committed_steps(run):
        assert Checkpointer.verify(run / f"step{step}", deep=True).ok
    manifest = json.loads((run / "step7" / ".manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert {"train/rank0.pt", "train/rank1.pt", "model_and_optim/.metadata"} <= set(
        manifest["files"]
    )
    written = {p.name for p in (run / "step7" / "model_and_optim").iterdir()}
    assert {f.split("/")[-1] for f in manifest["files"] if f.startswith("model_and_optim/")} == (
        written
    )


# -- the direct train-module API ----------------------------------------------------------------


def test_direct_module_saves_and_loads_itself_inside_the_commit(tmp_path, reference):
    folder = tmp_path / "run"
    stopped = build_trainer(tmp_path, folder, Run("trainckpt", stop=7, direct=True))
    stopped.fit()
    saves = [kw for name, kw in stopped.train_module.calls if name == "save"]
    assert len(saves) == 6  # steps 0, 2, 4, 5, 6 and 7
    assert set(saves[0]) == {"process_group", "save_overwrite", "thread_count", "throttle_uploads"}

    manifest = json.loads((folder / "step7" / ".manifest.json").read_text())
    written = {
        p.relative_to(folder / "step7").as_posix()
        for p in (folder / "step7" / "model_and_optim").iterdir()
    }
    assert written == {f for f in manifest["files"] if f.startswith("model_and_optim/")}
    assert "model_and_optim/.metadata" in written
    assert Checkpointer.verify(folder / "step7", deep=True).ok

    resumed = build_trainer(tmp_path, folder, Run("trainckpt", direct=True))
    resumed.fit()
    (name, load), *_ = resumed.train_module.calls
    assert name == "load" and set(load) == {
        "process_group",
        "pre_download",
        "work_dir",
        "thread_count",
        "load_optim_state",
        "reset_optimizer_states_on_load",
    }
    assert_identical(reference, snapshot(resumed))


def test_direct_module_reset_flag_and_async_refusal(tmp_path):
    trainer = build_trainer(tmp_path, tmp_path / "run", Run("trainckpt", direct=True))
    module, ckpt = trainer.train_module, trainer.checkpointer
    assert isinstance(module, DirectTrainModule) and isinstance(ckpt, Checkpointer)
    ckpt.save(tmp_path / "run" / "step3", module, {"global_step": 3})
    with pytest.raises(ConfigurationError, match="save_state_dict_direct"):
        ckpt.save_async(tmp_path / "run" / "step4", module, {"global_step": 4})

    # None on a resume: the module's reset_optimizer_states_on_resume, as OLMo-core does.
    module.reset_optimizer_states_on_resume = True  # type: ignore[attr-defined]
    ckpt.load(tmp_path / "run" / "step3", module)
    ckpt.load(tmp_path / "run" / "step3", module, load_trainer_state=False)
    ckpt.load(tmp_path / "run" / "step3", module, reset_optimizer_states_on_load=False)
    flags = [kw["reset_optimizer_states_on_load"] for name, kw in module.calls if name == "load"]
    assert flags == [True, None, False]


def test_reset_flag_without_direct_api_is_ignored_with_a_warning(tmp_path, caplog):
    """As in OLMo-core, only direct-API modules reset optimizer state; others load it all."""
    trainer = build_trainer(tmp_path, tmp_path / "run", Run("trainckpt"))
    module, ckpt = trainer.train_module, trainer.checkpointer
    ckpt.save(tmp_path / "run" / "step3", module, {"global_step": 3})
    with caplog.at_level("WARNING", logger="trainckpt"):
        state = ckpt.load(tmp_path / "run" / "step3", module, reset_optimizer_states_on_load=True)
    assert state == {"global_step": 3}
    assert "reset_optimizer_states_on_load=True has no effect" in caplog.text
    ckpt.close()


def test_direct_module_on_a_bucket(tmp_path, gcs_bucket):
    """Object stores stage each rank's files locally, then upload: the module writes into the
    staging folder and its files are uploaded and listed like any other."""
    trainer = build_trainer(tmp_path, tmp_path / "run", Run("trainckpt", direct=True))
    module, ckpt = trainer.train_module, trainer.checkpointer
    saved = snapshot(trainer)
    target = f"{gcs_bucket}/run/step3"
    ckpt.save(target, module, {"global_step": 3})
    report = Checkpointer.verify(target, deep=True)
    assert report.ok and report.manifest is not None
    assert "model_and_optim/.metadata" in report.manifest.files
    with torch.no_grad():
        for p in module.model.parameters():
            p.add_(1.0)
    assert ckpt.load(target, module) == {"global_step": 3}
    assert_identical(saved["model"], snapshot(trainer)["model"])
    ckpt.close()


def test_direct_module_never_sees_unsafe_dcp_metadata(tmp_path):
    """The direct module's own reader (OLMo-core's) unpickles `.metadata`; trainckpt reads it
    with its allow-list first, so a hostile one is refused before the module runs it."""
    trainer = build_trainer(tmp_path, tmp_path / "run", Run("trainckpt", direct=True))
    module, ckpt = trainer.train_module, trainer.checkpointer
    target = tmp_path / "run" / "step3"
    ckpt.save(target, module, {"global_step": 3})
    marker = tmp_path / "ran"
    (target / "model_and_optim" / ".metadata").write_bytes(
        pickle.dumps(_Touch(str(marker)))  # a pickle that creates `marker` when loaded
    )
    (target / ".manifest.json").unlink()  # unverifiable, like an OLMo-core checkpoint
    with pytest.raises(UnsafeCheckpointError):
        ckpt.load(target, module)
    assert not marker.exists()
    assert [name for name, _ in module.calls] == ["save"]


class _Touch:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


# -- configuration --------------------------------------------------------------------------------


def test_config_round_trips_through_olmo_core_config_machinery():
    cfg = TrainerConfig(
        save_folder="/runs/x",
        checkpointer=OLMoCheckpointerConfig(save_thread_count=2, verify_on_load="full"),
    )
    as_json = json.loads(json.dumps(cfg.as_config_dict()))
    assert as_json["checkpointer"]["verify_on_load"] == "full"
    back = TrainerConfig.from_dict(as_json)
    assert back.checkpointer == cfg.checkpointer
    merged = cfg.merge(["checkpointer.fs_timeout=5", "checkpointer.save_overwrite=true"])
    assert isinstance(merged.checkpointer, OLMoCheckpointerConfig)
    assert merged.checkpointer.fs_timeout == 5 and merged.checkpointer.save_overwrite is True
    with pytest.raises(ConfigurationError, match="fs_timeout"):
        OLMoCheckpointerConfig(fs_timeout=0)
    # One set of settings: the OLMo-core config has exactly CheckpointerConfig's fields.
    names = {f.name for f in dataclasses.fields(OLMoCheckpointerConfig)}
    assert names == set(CheckpointerConfig.model_fields)


def test_a_config_saved_under_the_old_class_path_still_loads():
    """Runs saved before the class moved name `trainckpt.olmo.OLMoCheckpointerConfig` in their
    `config.json`; OLMo-core imports that path to read them back."""
    saved = TrainerConfig(save_folder="/runs/x", checkpointer=OLMoCheckpointerConfig(fs_timeout=7))
    as_json = json.loads(json.dumps(saved.as_config_dict()))
    as_json["checkpointer"]["_CLASS_"] = "trainckpt.olmo.OLMoCheckpointerConfig"
    with pytest.warns(DeprecationWarning, match="trainckpt.olmo is deprecated"):
        sys.modules.pop("trainckpt.olmo", None)
        back = TrainerConfig.from_dict(as_json)
    assert isinstance(back.checkpointer, OLMoCheckpointerConfig)
    assert back.checkpointer.fs_timeout == 7


def test_trainer_config_fills_in_work_dir_and_save_overwrite(tmp_path):
    trainer = build_trainer(tmp_path, tmp_path / "run", Run("trainckpt"))
    assert isinstance(trainer.checkpointer, Checkpointer)
    assert trainer.checkpointer.work_dir == trainer.work_dir
    assert trainer.checkpointer.save_overwrite is False  # TrainerConfig's default
    own = CheckpointerConfig(work_dir=tmp_path / "mine", save_overwrite=True).build()
    assert own.work_dir == tmp_path / "mine" and own.save_overwrite
    default = CheckpointerConfig().build()  # unset: the Checkpointer's own defaults
    assert default.save_overwrite is False and default.work_dir.name.startswith("trainckpt-")
    for ckpt in (trainer.checkpointer, own, default):
        ckpt.close()


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(HELPER.parent), *sys.path]))


def _torchrun(root: Path, folder: Path, checkpointer: str, *args: str) -> None:
    cmd = [*TORCHRUN, str(HELPER), str(root), str(folder), checkpointer, "--ddp", *args]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
