"""Checkpoint figures on an OLMo-core Trainer's dashboard: `CheckpointMetricsCallback`.

Add it to the trainer's callbacks beside `CheckpointerCallback` (with `OLMoCheckpointerConfig`):
after every committed save, the save's `SaveReport.metrics()` (`checkpoint/blocked_s`,
`checkpoint/writing_s`, ..., `checkpoint/bytes`) are recorded with `trainer.record_metric`, so
they reach the trainer's loggers (console, W&B, Comet) with loss and throughput.

    callbacks={"checkpointer": CheckpointerCallback(...),
               "checkpoint_metrics": CheckpointMetricsCallback()}

Needs the `olmo` extra.
"""

from __future__ import annotations

from olmo_core.aliases import PathOrStr
from olmo_core.train.callbacks import Callback
from olmo_core.train.common import ReduceType

_SUMMED = ("checkpoint/bytes", "checkpoint/files", "checkpoint/throughput_mb_s")
"""Per-rank figures that add up across ranks; the times are reduced to the slowest rank's."""


class CheckpointMetricsCallback(Callback):
    """Records the figures of each committed save as trainer metrics.

    Called on: all ranks (OLMo-core calls `post_checkpoint_saved` on every rank, from the save's
    done-callback for async saves, before waiters of the save resume)."""

    def post_checkpoint_saved(self, path: PathOrStr) -> None:
        report = getattr(self.trainer.checkpointer, "last_save_report", None)
        if report is None:  # OLMo-core's own checkpointer: it reports nothing
            return
        for name, value in report.metrics().items():
            reduce = ReduceType.sum if name in _SUMMED else ReduceType.max
            self.trainer.record_metric(name, value, reduce_type=reduce)
