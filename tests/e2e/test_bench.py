"""`scripts/bench.py` runs end to end on a tiny state and prints its tables (so it cannot rot).
No time is asserted: only that every contender ran, loaded back what it saved, and reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_runs_and_prints_its_table(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    args = ["--size-mb", "8", "--repeats", "1", "--import-repeats", "1"]
    args += ["--gcs-size-mb", "4", "--gcs-checkpoints", "5", "--dir", str(tmp_path)]
    args += ["--train-size-mb", "4", "--local-size-mb", "4", "--json", str(out)]
    run = _bench(args)
    for row in (
        "raw write+fsync",
        "raw read",
        "torch.save+fsync",
        "plain DCP save",
        "trainckpt save",
        "trainckpt load",
        "trainckpt save_async: call blocks",
        "trainckpt save_async: until committed",
        "GCS trainckpt save",
        "GCS trainckpt load",
        "trainckpt latest_checkpoint (5 ckpts)",
        "import trainckpt after torch",
        "floor: other process write+fsync",
        "trainckpt save_async(overlap)",
        "DCP async_save (process)",
        "OLMo-core save_async",
        "copy floor: shm copy+process write",
        "torch_checkpointing (no fsync)",
        "target trainckpt save_async: training lost / copy floor",
        "local save_local blocked (rf=2)",
        "local save_local committed (rf=2)",
        "local load_local from the peer (rank 0's disk wiped)",
        "target local replication",
        "target local save_local committed (rf=1)",
        "local process-group transfer of the replica's bytes",
        "local phase (rf=2): send wait",
    ):
        assert row in run.stdout, row
    report = json.loads(out.read_text())
    assert report["async_files_identical_to_sync"] is True
    for name, r in report["results"].items():
        assert 0 < r["min"] <= r["median"] <= r["max"], name
    assert report["gcs"]["latest_checkpoint"]["trainckpt"]["requests"] >= 1
    assert all(s > 0 for s in report["local"]["medians"].values())
    training = report["training"]["results"]
    assert len(training) == 10  # 2 floors, 4 trainckpt modes, DCP thread and process, OLMo-core,
    # torch_checkpointing
    for name, r in training.items():
        assert _trained_during(r), name
        assert 0 < r["committed_s"]["min"] <= r["committed_s"]["max"], name
    assert list((tmp_path).iterdir()) == [out]  # the benchmark's own files are removed


@pytest.mark.slow
def test_bench_scale_runs_and_prints_its_tables(tmp_path: Path) -> None:
    """`--scale` on its tiny sizes: every contender saved and loaded back (the bench checks the
    loaded state), and each simulated function reported a time and a memory peak."""
    out = tmp_path / "scale.json"
    args = ["--scale", "--scale-entries", "400", "--scale-ranks", "2,4", "--scale-tensors", "2"]
    args += ["--scale-training-entries", "400", "--scale-load", "8x128"]
    args += ["--repeats", "1", "--scale-sampled-s", "0.3", "--dir", str(tmp_path)]
    run = _bench([*args, "--json", str(out)])
    scale = json.loads(out.read_text())["scale"]
    load = scale["rank_load"]
    assert load["chunks"] == 8 * 128 and load["native_bytes"] > 0
    # a rank's row shard of each of the 8 tensors: one saved chunk each, two when resharded
    assert (load["items"], load["items_resharded"]) == (8, 16)
    contenders = scale["entries"]["results"]
    assert {"trainckpt save", "trainckpt save_async", "plain DCP", "OLMo-core"} <= set(contenders)
    for label, by_size in contenders.items():
        assert by_size["400"]["entries"] == 400, label
        assert by_size["400"]["save_s"] > 0 and by_size["400"]["load_s"] > 0, label
        assert by_size["400"]["first_save_s"] > 0, label  # timed apart from the medians
        # the first save not among them; a small state is repeated more (`size_repeats`)
        repeats = by_size["400"]["repeats"]
        assert 1 <= repeats <= 5 and len(by_size["400"]["save_samples"]) == repeats, label
        assert len(by_size["400"]["load_samples"]) == repeats, label
        assert label in run.stdout
    assert "first save s" in run.stdout
    ranks = scale["ranks"]["results"]
    assert set(ranks) == {"2", "4"}
    for row in ranks.values():
        timed = {k: v for k, v in row.items() if isinstance(v, dict)}
        assert len(timed) == 6  # with the read of trainckpt's own metadata record
        assert all(v["s"] > 0 and v["peak_mb"] > 0 for v in timed.values())
    assert "target simulated 4 ranks: rank 0 commit work" in run.stdout
    assert "target safe unpickle / pickle at every simulated size: worst" in run.stdout
    assert "2: " in run.stdout.split("at every simulated size")[1]  # each size's ratio named
    foreign = scale["foreign"]["400"]  # DCP's own one-rank .metadata of the 400-entry state
    assert foreign["entries"] == 400 and foreign["metadata_bytes"] > 0
    assert foreign["safe unpickle"]["s"] > 0 and foreign["pickle.loads"]["s"] > 0
    assert "target safe unpickle / pickle on DCP's own one-rank .metadata: worst" in run.stdout
    training = scale["training"]
    assert training["entries"] == 400
    for name, r in training["results"].items():  # the copy floor and three trainckpt modes
        assert _trained_during(r), name
        assert 0 < r["committed_s"]["min"], name
    assert len(training["results"]) == 4
    assert "target background save of 400 entries, best mode" in run.stdout
    assert list(tmp_path.iterdir()) == [out]


@pytest.mark.slow
def test_bench_incremental_runs_and_prints_its_table(tmp_path: Path) -> None:
    """`--incremental` on a tiny frozen base: three saves per contender, each with its bytes
    written; from the second on, trainckpt writes (and uploads to GCS) only a sliver of it."""
    out = tmp_path / "inc.json"
    args = ["--incremental", "--incremental-size-mb", "8", "--incremental-entries", "800"]
    args += ["--repeats", "1"]
    args += ["--dir", str(tmp_path), "--json", str(out)]
    run = _bench(args)
    inc = json.loads(out.read_text())["incremental"]
    ours = inc["local"]["trainckpt save_async (incremental)"]
    assert [r["save"] for r in ours] == [1, 2, 3]
    assert ours[0]["bytes_written"] > inc["frozen_bytes"]
    assert all(r["bytes_written"] < inc["frozen_bytes"] / 4 for r in ours[1:])
    assert all(r["bytes_uploaded"] < inc["frozen_bytes"] / 4 for r in inc["gcs"]["trainckpt"][1:])
    assert {"DCP async_save (thread)", "OLMo-core save_async"} <= set(inc["local"])
    assert "target save 2: bytes" in run.stdout
    assert "target fully trained (8 MB), saves 6-9" in run.stdout
    assert "target fully trained (800 entries), saves 6-9" in run.stdout
    assert len(inc["fully_trained_entries"]["samples"]["on"]["steady"]) == 4
    assert list(tmp_path.iterdir()) == [out]


def _bench(args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run scripts/bench.py with `args`; it must exit 0."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def _trained_during(r: dict[str, Any]) -> bool:
    """Training went on during every save of a training-loop row, unless the save committed
    within one training step (the copy floor of a tiny state can, with no step started)."""
    within_a_step = r["committed_s"]["max"] <= r["step_before_s"]["max"]
    return r["steps_during"]["min"] >= 1 or within_a_step


def test_a_small_state_is_sampled_more_but_at_most_five_times_as_often() -> None:
    """`--scale` repeats a state until its samples add up to about 2 s (a 0.1 s median is
    what the growth of the cost per entry is divided by), never fewer than `--repeats`."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from bench_scale import size_repeats

    assert size_repeats(3, 0.05) == 15  # capped at 5x
    assert size_repeats(3, 0.4) == 5
    assert size_repeats(3, 1.5) == 3  # never fewer than asked
    assert size_repeats(1, 0.0) == 5


def test_the_torch_checkpointing_peer_waits_for_its_staging_before_the_optimizer_step(
    tmp_path: Path,
) -> None:
    """The training bench's `torch_checkpointing` contender copies the state on a thread after
    `save` returns; the trainer takes its manager's lock before the optimizer step (that
    library's contract), so a step changing every parameter right after never reaches the
    checkpoint, in every trial: its measured training time includes that wait."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    from bench_common import make_module
    from bench_train import _torch_checkpointing
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import SyncCheckpointSaverConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

    module = make_module(48)
    start, close = _torch_checkpointing(module)
    reader = CheckpointManager(
        CheckpointManager.Config(
            save=SyncCheckpointSaverConfig(),
            storage_config=LocalFileSystemStorageConfig(use_direct_io=False),
        )
    )
    params = list(module.model.parameters())
    try:
        for trial in range(3):
            saved = [p.detach().clone() for p in params]
            save = start(tmp_path / f"step{trial}")
            assert save.before_optim_step is not None
            save.before_optim_step()
            with torch.no_grad():
                for p in params:
                    p.add_(1.0)  # the optimizer step, right after the wait
            assert save.committed.wait(300) and save.error is None
            into = {"model": {k: torch.zeros_like(v) for k, v in module.model.state_dict().items()}}
            reader.load(str(tmp_path / f"step{trial}"), into=into)
            for got, want in zip(into["model"].values(), saved, strict=True):
                assert torch.equal(got, want), trial
    finally:
        close()
        reader.close()
