"""`ckpt.local`: the node-local tier as a `Checkpointer` exposes it (docs/local-tier.md).

`LocalCheckpoints` saves through the checkpointer's one save thread (a local save and a save to
the save folder never run at once) and restores through `LocalTier`. `Checkpointer.save_local`,
`latest_local`, `load_local` and `load_latest_local` are thin aliases of its methods.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from trainckpt.core import dist
from trainckpt.core.self_saving_module import saves_directly
from trainckpt.errors import ConfigurationError
from trainckpt.local.module_state import load_into
from trainckpt.local.tier import LocalTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveThread:
    """What the façade borrows from its checkpointer: the save thread that local saves and
    saves to the save folder share (one save runs at a time)."""

    finish_pending: Callable[[], object]
    """Wait for the save in flight; raise its error if it failed."""
    stage: Callable[[str, Any, dict[str, Any]], tuple[bytes, dict[str, Any]]]
    """(where, train module, train state) -> (serialized trainer state, module state staged in
    CPU memory); every rank learns whether every rank succeeded."""
    submit: Callable[[str, Callable[[], str], Future[None]], Future[str]]
    """(where, write-and-commit, staging done) -> the future of the commit, run on the save
    thread."""


class LocalCheckpoints:
    """The node-local tier of a checkpointer: `save`, `latest`, `load`, `load_latest`. Without
    `local_dir` in the settings each of them raises `ConfigurationError`. `train_module` is a
    `TrainModule`. Every method is called on all ranks."""

    def __init__(
        self, tier: LocalTier | None, group: dist.ProcessGroup | None, thread: SaveThread
    ) -> None:
        self._tier_or_none, self._group, self._thread = tier, group, thread

    def save(self, step: int, train_module: Any, train_state: dict[str, Any]) -> Future[str]:
        """Save `step`: each rank's part to its node's `local_dir`, replicas to peers on other
        nodes, then the two-phase commit.

        Returns once the state is staged in CPU memory (the caller may step the optimizer);
        writing, replication and the commit run on the save thread, and the future resolves
        (to the step's local folder) only when the step is committed on every rank. One save
        runs at a time, local or not: this call first waits for the previous one.
        """
        tier = self._tier("local.save")
        if saves_directly(train_module):
            raise ConfigurationError(
                f"cannot save step {step} to the local tier: {type(train_module).__name__} "
                "writes its state itself (save_state_dict_direct), so it cannot be staged"
            )
        self._thread.finish_pending()
        start = time.perf_counter()
        where = str(tier.root / f"step{step}")
        trainer_bytes, state = self._thread.stage(where, train_module, train_state)
        log.info(
            "staged local checkpoint step %d in %.2fs; writing and replicating in the background",
            step,
            time.perf_counter() - start,
        )
        staged: Future[None] = Future()
        staged.set_result(None)

        def run() -> str:
            tier.save(step, state, trainer_bytes)
            return where

        return self._thread.submit(where, run, staged)

    def latest(self) -> int | None:
        """The newest step that the live ranks can assemble (every rank's part held
        intact-sized by some rank, all of one save attempt), or None; the same answer on every
        rank. Saves of another world size do not count (a warning says so). Waits for an
        in-flight save first."""
        tier = self._tier("local.latest")
        self._thread.finish_pending()
        return tier.latest()

    def load(self, step: int, train_module: Any) -> dict[str, Any] | None:
        """Load `step` into `train_module`; return this rank's trainer state.

        Each rank reads its own part from its node's disk, or receives it from a rank on
        another node that holds a replica; every copy is CRC32C-checked and a damaged one is
        replaced by the next. Raises `CheckpointNotFoundError` when the live ranks cannot
        assemble `step`, `CorruptCheckpointError` when some part has no intact copy left (then
        load an older step, or from the save folder).
        """
        tier = self._tier("local.load")
        self._thread.finish_pending()
        start = time.perf_counter()
        state, trainer_state = tier.restore(step)
        where = self._apply(train_module, state, step, tier)
        log.info("loaded %s in %.2fs", where, time.perf_counter() - start)
        return trainer_state

    def load_latest(self, train_module: Any) -> tuple[int, dict[str, Any]] | None:
        """Load the newest step that restores: `latest()`, falling back to the next older step
        the live ranks can assemble when some part of a step has no intact copy left (logged).
        Returns (step, this rank's trainer state), or None when no step restores (then load
        from the save folder)."""
        tier = self._tier("local.load_latest")
        self._thread.finish_pending()
        got = tier.restore_latest()
        if got is None:
            return None
        step, state, trainer_state = got
        where = self._apply(train_module, state, step, tier)
        log.info("loaded %s", where)
        return step, trainer_state

    def _apply(self, train_module: Any, state: dict[str, Any], step: int, tier: LocalTier) -> str:
        """Load a restored part into the module on every rank; every rank learns whether all
        did. Returns a name of the step for logs."""
        where = f"local checkpoint step {step} under '{tier.root}'"
        error: Exception | None = None
        try:
            load_into(train_module, state, where)
        except Exception as e:
            error = e
        dist.agree(error, f"loading {where}", self._group)
        return where

    def _tier(self, what: str) -> LocalTier:
        if self._tier_or_none is None:
            raise ConfigurationError(
                f"{what}: this checkpointer has no local tier; set local_dir (a folder on "
                "each node's own disk, the same path on every node) in CheckpointerConfig"
            )
        return self._tier_or_none
