"""The checkpoint events a `CheckpointManager` logs: a save it started (`SaveEvent`), its end on
the save thread (`on_done`), its commit with size and rate (`log_committed`). Apart so the
manager reads as the per-step driver. Called on: all ranks (`log_committed`: rank 0)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from trainckpt.format.folder import checkpoint_size
from trainckpt.retention.policy import SaveKind
from trainckpt.storage import resolve

log = logging.getLogger("trainckpt.manager")  # the manager's events, under the manager's name


@dataclass
class SaveEvent:
    """A save the manager started: what, where, when it started and ended."""

    step: int
    path: str
    kind: SaveKind
    started: float
    ended: float | None = None
    """When the save ended (set on the save thread), for the commit event's seconds and MB/s."""


def on_done(save: SaveEvent, future: Future[str]) -> None:
    """Runs on the save thread when an async save ends: note the time; log a failure now."""
    save.ended = time.perf_counter()
    error = future.exception()
    if error is not None:
        log.error(
            "checkpoint event: %s checkpoint '%s' failed (%s); earlier checkpoints are kept",
            save.kind.value,
            save.path,
            error,
        )


def log_committed(save: SaveEvent, seconds: float) -> None:
    """Log that `save` committed, with its size and rate (rank 0, retention thread)."""
    size = checkpoint_size(*resolve(save.path))
    rate = f", {size / 1e6:.1f} MB, {size / 1e6 / max(seconds, 1e-9):.1f} MB/s" if size else ""
    log.info(
        "checkpoint event: committed %s '%s' in %.2fs%s",
        save.kind.value,
        save.path,
        seconds,
        rate,
    )
