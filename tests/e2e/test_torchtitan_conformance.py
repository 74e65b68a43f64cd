"""trainckpt's torchtitan manager where torchtitan's own unit tests (tests/unit_tests/
test_checkpoint.py, import swapped) found it differing, as real saves and loads with torchtitan's
own components beside torchtitan's own manager: config case, raw tensors and `None` in
`states`, the `load_step` error's wording, a step re-saved in place by torchtitan's manager, and
the class name. docs/torchtitan.md lists the unit tests that stay torchtitan's own."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from support import titan_run as tr

from trainckpt import Checkpointer
from trainckpt.integrations import torchtitan as integration

pytestmark = pytest.mark.usefixtures("single_rank")  # conftest.py: a gloo group of one rank


def test_class_name_and_alias() -> None:
    assert integration.TorchtitanCheckpointManager is integration.CheckpointManager
    assert integration.TorchtitanCheckpointManager.__name__ == "TorchtitanCheckpointManager"


@pytest.mark.parametrize("given, expected", [("DISABLED", "disabled"), ("Async", "async")])
def test_async_mode_any_case(given: str, expected: str) -> None:
    config = integration.CheckpointManager.Config(async_mode=given)  # type: ignore[arg-type]
    assert config.async_mode == expected
    with pytest.raises(ValueError, match="Invalid async_mode"):
        integration.CheckpointManager.Config(async_mode="sometimes")  # type: ignore[arg-type]


def _manager(kind: str, run: tr.Run, folder: Path, states: dict[str, Any], **config: Any) -> Any:
    """A manager of `kind` with `states` and no data loader (`dataloader=None`)."""
    cls = tr.TitanManager if kind == "torchtitan" else integration.CheckpointManager
    cfg = cls.Config(enable=True, folder=str(folder), interval=1, keep_latest_k=0, **config)
    return cfg.build(
        dataloader=None,
        model_parts=[run.model],
        optimizers=run.optimizers,
        lr_schedulers=run.lr_schedulers,
        states=states,
        sd_adapter=run.adapter,
        base_folder="",
    )


@pytest.mark.parametrize(
    "writer, reader", [("trainckpt", "torchtitan"), ("torchtitan", "trainckpt")]
)
def test_raw_tensors_and_a_missing_data_loader_interchange(
    writer: str, reader: str, tmp_path: Path
) -> None:
    folder = tmp_path / "ckpt"
    run = tr.build(2)
    extra = torch.arange(4.0)
    saver = _manager(writer, run, folder, {"train_state": run.train_state, "extra": extra})
    saver.save(1)
    saver.close()

    extra.zero_()
    run.train_state.step = 0
    loader = _manager(reader, run, folder, {"train_state": run.train_state, "extra": extra})
    assert loader.load(step=1)
    loader.close()
    assert torch.equal(extra, torch.arange(4.0))  # filled in place, as torchtitan does


def test_missing_load_step_uses_torchtitans_words(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    run = tr.build(2)
    ckpt = tr.manager("trainckpt", run, folder, interval=1, keep_latest_k=0)
    tr.train(run, ckpt, stop=1)
    ckpt.close()
    with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=5 not found"):
        tr.train(run, tr.manager("trainckpt", run, folder), load_step=5)
    with pytest.raises(FileNotFoundError, match="--checkpoint.load_step=5 not found because"):
        tr.train(run, tr.manager("trainckpt", run, tmp_path / "none"), load_step=5)


_CONFIG = {"interval": 2, "keep_latest_k": 0, "last_save_model_only": False}


def _ours_to_step_4(folder: Path) -> None:
    run = tr.build(4)
    ckpt = tr.manager("trainckpt", run, folder, **_CONFIG)
    tr.train(run, ckpt)
    ckpt.close()
    assert [s for s, _ in Checkpointer.find_checkpoints(folder)] == [2, 4]


def _resume_step(folder: Path, **config: Any) -> int:
    run = tr.build(4, seed=99)
    ckpt = tr.manager("trainckpt", run, folder, **{**_CONFIG, **config})
    tr.train(run, ckpt, stop=0)
    ckpt.close()
    return run.train_state.step


def test_a_step_torchtitan_saved_again_in_place_loads_as_foreign(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "ckpt"
    _ours_to_step_4(folder)
    # torchtitan's own manager resumes from step 2 on other data and saves step 4 over ours.
    theirs = tr.build(4)
    ckpt = tr.manager("torchtitan", theirs, folder, exclude_from_loading=["dataloader"], **_CONFIG)
    tr.train(theirs, ckpt, load_step=2)
    ckpt.close()
    assert not Checkpointer.verify(folder / "step-4").ok  # our manifest no longer fits

    run = tr.build(4, seed=99)
    ckpt = tr.manager("trainckpt", run, folder, **_CONFIG)
    with caplog.at_level(logging.WARNING):
        tr.train(run, ckpt, stop=0)
    ckpt.close()
    assert run.train_state.step == 4  # not a fall back to step 2
    assert "unverified foreign checkpoint" in caplog.text
    for key, value in theirs.model.state_dict().items():
        assert torch.equal(run.model.state_dict()[key], value), key


@pytest.mark.parametrize("damage", ["flipped byte", "missing file"])
def test_damage_to_our_own_files_is_still_refused(damage: str, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _ours_to_step_4(folder)
    shards = sorted((folder / "step-4").glob("*.distcp"), key=lambda p: p.stat().st_size)
    if damage == "missing file":
        shards[0].unlink()
    else:
        data = bytearray(shards[-1].read_bytes())
        data[len(data) // 2] ^= 0xFF
        shards[-1].write_bytes(bytes(data))
    assert _resume_step(folder, verify_on_load="full") == 2  # step 4 skipped as damaged
