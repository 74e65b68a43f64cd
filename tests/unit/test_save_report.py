"""The figures of each save reach the trainer: `SaveReport` on the returned path, on the
future's result, on the checkpointer and on the manager; bytes and files match what the
manifest says was written, and the phases add up."""

from __future__ import annotations

import pickle
from pathlib import Path

import torch
from support.models import make_module

from trainckpt import CheckpointerConfig, CheckpointManager, CheckpointPolicy, SaveReport
from trainckpt.format.records import read_manifest
from trainckpt.storage import resolve


def manifest_sizes(path: str) -> list[int]:
    storage, p = resolve(path)
    return [e.size for e in read_manifest(storage, p).files.values()]


def check(report: SaveReport, path: str) -> None:
    sizes = manifest_sizes(path)
    assert (report.files, report.bytes) == (len(sizes), sum(sizes)) and report.bytes > 0
    assert report.path == path
    for phase in (report.blocked, report.staging, report.writing, report.commit):
        assert 0 <= phase <= report.total
    assert report.writing + report.commit <= report.total + 1e-6
    assert report.throughput == report.bytes / report.total
    metrics = report.metrics()
    assert metrics["checkpoint/bytes"] == report.bytes
    assert set(metrics) == {
        f"checkpoint/{name}"
        for name in (
            "blocked_s",
            "staging_s",
            "writing_s",
            "commit_s",
            "total_s",
            "bytes",
            "files",
            "throughput_mb_s",
        )
    }


def test_sync_and_async_saves_report_their_figures(tmp_path: Path):
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    module = make_module(seed=1, steps=1)
    try:
        path = ckpt.save(str(tmp_path / "run" / "step1"), module, {"step": 1})
        assert isinstance(path, str) and path == str(tmp_path / "run" / "step1")
        check(path.report, path)
        assert path.report.blocked == path.report.total and path.report.staging == 0
        assert ckpt.last_save_report is path.report

        for overlap in (False, True):
            future = ckpt.save_async(
                str(tmp_path / "run" / f"step{2 + overlap}"),
                module,
                {"step": 2},
                overlap_staging=overlap,
            )
            ckpt.wait_for_staging()
            committed = future.result()
            check(committed.report, committed)
            assert committed.report.blocked <= committed.report.total
            assert ckpt.last_save_report is committed.report
        copy = pickle.loads(pickle.dumps(committed))  # crosses processes and ranks whole
        assert copy == committed and copy.report == committed.report
    finally:
        ckpt.close()


def test_the_manager_hands_out_the_last_report(tmp_path: Path):
    ckpt = CheckpointerConfig(work_dir=tmp_path / "work").build()
    module = make_module(seed=2, steps=1)
    manager = CheckpointManager(
        ckpt, CheckpointPolicy(save_interval=2, pre_train_checkpoint=False), tmp_path / "run"
    )
    try:
        assert manager.last_report is None
        for step in range(1, 5):
            manager.maybe_save(step, module, {"step": step, "rng": torch.get_rng_state()})
        manager.finish()
        report = manager.last_report
        assert report is not None and report.path.endswith("step4")
        check(report, report.path)
    finally:
        ckpt.close()
