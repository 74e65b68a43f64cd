"""OLMo-core's real Trainer (tiny, CPU, in this process) with `CheckpointMetricsCallback`: the
figures of its checkpoint saves reach the trainer's metrics, the path its loggers read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from olmo_core.train.callbacks import Callback
from support.olmo_trainer import Run, build_trainer

from trainckpt.integrations.olmo_metrics import CheckpointMetricsCallback


class Captured(Callback):
    """Keeps every batch of metrics the trainer logs."""

    def __init__(self) -> None:
        self.logged: list[dict[str, float]] = []

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        self.logged.append({k: float(v) for k, v in metrics.items()})


def test_checkpoint_figures_are_recorded_as_trainer_metrics(tmp_path: Path):
    """An async save (the harder case: recorded from the save's done-callback) at step 2."""
    trainer = build_trainer(tmp_path, tmp_path / "run", Run("trainckpt", save_async=True, stop=2))
    captured = Captured()
    for name, callback in (("checkpoint_metrics", CheckpointMetricsCallback()), ("x", captured)):
        callback.trainer = trainer
        trainer.callbacks[name] = callback
    trainer.fit()
    recorded = [m for m in captured.logged if "checkpoint/bytes" in m]
    assert recorded, [sorted(m) for m in captured.logged]
    metrics = recorded[-1]
    report = trainer.checkpointer.last_save_report  # type: ignore[attr-defined]
    assert metrics["checkpoint/bytes"] > 0 and metrics["checkpoint/files"] >= 2
    assert metrics["checkpoint/bytes"] == report.bytes
    for name in ("checkpoint/total_s", "checkpoint/writing_s", "checkpoint/blocked_s"):
        assert 0 <= metrics[name] <= report.total, name
