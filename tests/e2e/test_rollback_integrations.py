"""Rolling back (docs/design.md §11) through the integrations: torchtitan's `load_step` with
trainckpt's torchtitan manager, and OLMo-core's real Trainer loading an older step of its save
folder. The newer checkpoints are never resumed from again, and the new trajectory's saves are
written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import olmo_trainer
from support import titan_run as tr

from trainckpt import Checkpointer

pytestmark = pytest.mark.slow


def _steps(folder: Path) -> list[int]:
    return [s for s, _ in Checkpointer.find_checkpoints(folder)]


_CONFIG = {"interval": 2, "keep_latest_k": 0, "last_save_model_only": False}


def _titan(folder: Path, load_step: int, stop: int | None = None, **config) -> tr.Run:
    """A run that loads `load_step` (-1: the newest) and trains to `stop`, then closes."""
    run = tr.build(6, seed=99)
    ckpt = tr.manager("trainckpt", run, folder, **_CONFIG, **config)
    tr.train(run, ckpt, load_step=load_step, stop=stop)
    ckpt.close()
    return run


@pytest.mark.usefixtures("single_rank")
def test_torchtitan_load_step_rolls_back(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    first = tr.build(6)
    ckpt = tr.manager("trainckpt", first, folder, **_CONFIG)
    tr.train(first, ckpt)
    ckpt.close()
    assert _steps(folder) == [2, 4, 6]

    # Roll back to step 2 and train on other data (the data loader's position is not loaded:
    # the run reads from the start again), stopping at step 3, before it saves step 4.
    _titan(folder, load_step=2, stop=3, exclude_from_loading=["dataloader"])
    assert _steps(folder) == [2]
    restarted = _titan(folder, load_step=-1, stop=2)  # as after a crash: the newest is step 2
    assert restarted.train_state.step == 2

    # The rolled-back run goes on to step 6: its steps 4 and 6 are written, over the old ones.
    second = _titan(folder, load_step=2, exclude_from_loading=["dataloader"])
    assert _steps(folder) == [2, 4, 6]
    resumed = _titan(folder, load_step=-1, stop=6)
    assert resumed.train_state.step == 6
    for key, value in second.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[key], value), key
    assert not torch.equal(
        first.model.state_dict()["norm.weight"], second.model.state_dict()["norm.weight"]
    )


def test_olmo_core_trainer_loading_an_older_step_rolls_back(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    uninterrupted = olmo_trainer.train(tmp_path, folder, olmo_trainer.Run())
    assert max(_steps(folder)) == olmo_trainer.STEPS

    # Load step 5 explicitly (a rollback), train to the hard stop at step 7. With
    # RollbackOnLoadCallback the newer steps are abandoned at the load: a crash before the
    # first save would resume from step 5, never from the abandoned step 10.
    run = olmo_trainer.Run(stop=7, rollback_on_load=True)
    trainer = olmo_trainer.build_trainer(tmp_path, folder, run)
    trainer.load_checkpoint(str(folder / "step5"))
    assert Checkpointer.latest_checkpoint(folder) == str(folder / "step5")
    trainer.fit()
    assert max(_steps(folder)) == 7  # steps 8 and 10 of the first run are never found again
    assert Checkpointer.latest_checkpoint(folder) == str(folder / "step7")

    # Resuming goes on from step 7 and writes step 10 again (no CheckpointExistsError).
    resumed = olmo_trainer.train(tmp_path, folder, olmo_trainer.Run())
    olmo_trainer.assert_identical(uninterrupted, resumed)
    assert max(_steps(folder)) == olmo_trainer.STEPS
    assert Checkpointer.verify(folder / "step10", deep=True).ok
