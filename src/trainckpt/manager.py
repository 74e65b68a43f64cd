"""`CheckpointManager`: the per-step driver a training loop calls. It asks a `CheckpointPolicy`
what to save, saves (sync or async, at most one async save in flight), and once a save is
committed has old checkpoints deleted on a background thread.

Rollback rule (docs/design.md §11): the committed steps of a save folder are one trajectory; once a
run starts from an older step, the newer checkpoints are abandoned and the run's own saves of
those steps replace them.

Failure rule: a failed save deletes nothing (deletion rounds start only from a committed save),
is logged when it happens, and is raised as `CheckpointError` by the next call that saves
(`maybe_save` on a save step, `save`) or by `finish()`, whichever comes first. Raising only at
save steps keeps ranks in step: every rank decides to save at the same steps.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from trainckpt.checkpointer import Checkpointer
from trainckpt.core import dist
from trainckpt.errors import CheckpointError, ConfigurationError, CorruptCheckpointError
from trainckpt.format import layout
from trainckpt.format.folder import abandon_newer, find_checkpoints
from trainckpt.retention.policy import CheckpointPolicy, SaveKind
from trainckpt.retention.remover import Remover
from trainckpt.save_events import SaveEvent, log_committed, on_done
from trainckpt.storage import resolve
from trainckpt.train_module import TrainModule

if TYPE_CHECKING:
    from trainckpt.core.save_report import SaveReport

log = logging.getLogger(__name__)

TrainState = dict[str, Any] | Callable[[], dict[str, Any]]
"""Trainer state, or a function building it (called only when a checkpoint is saved)."""


class CheckpointManager:
    """Drives checkpointing of one training run into `save_folder` (local path or URL), in
    step folders named by `naming` (`step1000`, or torchtitan's `step-1000`).

    Build it on every rank, `resume` (or `start_from` the step you loaded yourself), then call
    `maybe_save(step, ...)` after every finished step (and once with step 0 before training,
    for the pre-train checkpoint), `save` for an explicit checkpoint (end of training,
    SIGTERM), and `finish()` at the end. A run that resumes from an older step than the newest
    abandons the newer ones (`start_from`, docs/rollback.md).

    Called on: all ranks (construction reads the folder on rank 0 and shares what it found).
    """

    def __init__(
        self,
        checkpointer: Checkpointer,
        policy: CheckpointPolicy,
        save_folder: str | os.PathLike[str],
        *,
        naming: layout.Naming = "trainckpt",
    ) -> None:
        self.checkpointer = checkpointer
        self.policy = policy
        self.save_folder = str(save_folder)
        self.naming: layout.Naming = naming
        self._group = checkpointer.process_group
        # Rank 0 lists the folder once; every rank gets the same steps, so every rank makes the
        # same decisions (which steps are already saved, how old the last checkpoint is).
        steps = dist.run_on_rank0(
            lambda: _committed_steps(self.save_folder),
            f"reading the checkpoints in '{self.save_folder}'",
            self._group,
        )
        self._saved: dict[int, str] = dict(steps)
        """Steps saved (or being saved) by this run, and those of the folder up to the step it
        resumed from once `start_from` ran: a save of one of them is only waited for."""
        self._last_saved: int | None = None
        self._started = False
        self._pending: SaveEvent | None = None
        self._in_flight: Future[str] | None = None
        self._remover = (
            Remover(self.save_folder, policy) if dist.get_rank(self._group) == 0 else None
        )
        self._finished = False
        self.resumed_from: str | None = None
        """Where `resume` loaded from: a save-folder checkpoint or a local-tier step folder."""
        if policy.local_save_interval is not None and checkpointer.local_dir is None:
            raise ConfigurationError(
                f"the policy sets local_save_interval={policy.local_save_interval}, but the "
                "checkpointer has no local tier: set local_dir in CheckpointerConfig"
            )

    # -- per step -------------------------------------------------------------------------------
    def maybe_save(
        self, step: int, train_module: TrainModule, train_state: TrainState
    ) -> str | None:
        """Save a checkpoint of `step` if the policy asks for one; return its path (committed
        when sync, in flight when async) or None. Raises `CheckpointError` for an earlier async
        save that failed.

        Called on: all ranks, after every finished step.
        """
        if not self._started:
            self.start_from(step)  # no `resume`, no `start_from`: the first step seen
        kind = self.policy.decide(step, self._last_saved)
        if kind is None:
            return None
        return self._save(step, train_module, train_state, kind, self.policy.save_async)

    def save(
        self,
        step: int,
        train_module: TrainModule,
        train_state: TrainState,
        *,
        ephemeral: bool = False,
    ) -> str:
        """Save a checkpoint of `step` now and wait until it is committed (e.g. at the end of
        training or on SIGTERM); a step this run already saved (or has in flight), or the one
        it resumed from, of whatever kind, is only waited for, so a trainer's final save should
        not follow `maybe_save` of the same step. Returns its path.

        Called on: all ranks.
        """
        if not self._started:
            self.start_from(step)
        kind = SaveKind.EPHEMERAL if ephemeral else SaveKind.PERMANENT
        path = self._save(step, train_module, train_state, kind, save_async=False)
        if self._pending is not None and self._pending.step == step:
            self._collect_pending()
        return path

    def start_from(self, step: int | None) -> list[int]:
        """Settle where this run's trajectory starts: it resumed from `step` (None: from
        scratch). Committed checkpoints of newer steps are abandoned (docs/design.md §11, logged
        as a WARNING naming them): no finder reports them again, and each is replaced, crash-safe,
        when the run saves that step. Returns the abandoned steps.

        `resume` calls it; call it yourself, before the first save, when you load a checkpoint
        by other means (and again after loading an older step mid-run: the save in flight is
        waited for first). Without it the first step passed to `maybe_save` or `save` is taken
        as the step resumed from. Called on: all ranks (rank 0 reads and marks the folder).
        """
        self._collect_pending()
        self._started = True
        since = -1 if step is None else step
        abandoned = dist.run_on_rank0(
            lambda: abandon_newer(
                *resolve(self.save_folder),
                since,
                refuse=self.checkpointer.on_rollback == "refuse",
            ),
            f"abandoning the checkpoints newer than step {since} in '{self.save_folder}'",
            self._group,
        )
        for s, _ in abandoned:
            self._saved.pop(s, None)
        self._last_saved = max((s for s in self._saved if s <= since), default=None)
        return [s for s, _ in abandoned]

    def save_final(self, step: int, train_module: TrainModule, train_state: TrainState) -> str:
        """Save the last checkpoint of the run, permanent, as the policy's `final_save` says:
        the full state, or (`model_only`) the model weights cast to `final_dtype`. Either way
        a normal committed checkpoint. Returns its path.

        Called on: all ranks.
        """
        if self.policy.final_save == "model_only":
            weights = getattr(train_module, "weights", None)
            if not callable(weights):
                raise ConfigurationError(
                    "final_save='model_only' needs a train module with a weights(dtype) view "
                    f"(ModelAndOptim, ModelAndStates; got {type(train_module).__name__}); save "
                    "ModelWeights-like state yourself or use final_save='full'"
                )
            dtype = getattr(torch, self.policy.final_dtype) if self.policy.final_dtype else None
            train_module = weights(dtype)
        return self.save(step, train_module, train_state)

    def resume(self, train_module: TrainModule) -> tuple[int, dict[str, Any] | None] | None:
        """Load the newest step that verifies across both tiers into `train_module`: the
        newest good checkpoint of the save folder, or the local tier's newest step the live
        ranks can assemble when it is newer (falling back to the save folder when that step
        cannot be restored, logged). Returns (step, this rank's trainer state), or None when
        neither tier has one. Call it before the first `maybe_save`. Checkpoints newer than
        the one loaded (damaged ones it skipped) are abandoned (`start_from`).

        Called on: all ranks.
        """
        path = self.checkpointer.find_latest_good(self.save_folder)
        saved = None if path is None else layout.parse_step(path.rstrip("/").rsplit("/", 1)[-1])
        if self.checkpointer.local_dir is not None:
            local = self.checkpointer.latest_local()
            if local is not None and (saved is None or local > saved):
                try:
                    state = self.checkpointer.load_local(local, train_module)
                except CorruptCheckpointError as e:
                    log.warning(
                        "local step %d cannot be restored (%s); using the save folder", local, e
                    )
                else:
                    self.resumed_from = str(Path(str(self.checkpointer.local_dir)) / f"step{local}")
                    log.info(
                        "resuming from the local tier, step %d (save folder: %s)", local, saved
                    )
                    self.start_from(local)
                    return local, state
        if path is None or saved is None:
            self.start_from(None)
            return None
        log.info("resuming from '%s' (step %d)", path, saved)
        self.resumed_from = path
        state = self.checkpointer.load(path, train_module)
        self.start_from(saved)
        return saved, state

    def wait_for_staging(self) -> None:
        """Block until the state of the last background save is copied to CPU memory (with
        the policy's `overlap_staging`); call it before the optimizer step. Returns at once
        when nothing is being staged; raises `CheckpointError` if staging failed.

        Called on: all ranks.
        """
        try:
            self.checkpointer.wait_for_staging()
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(
                f"staging the checkpoint into CPU memory failed ({type(e).__name__}: {e}); "
                f"the save to '{self.save_folder}' is abandoned and earlier checkpoints are kept"
            ) from e

    def finish(self) -> None:
        """Wait for the in-flight save and every deletion; raise `CheckpointError` for a save
        not yet reported or a deletion that failed (deletions run on rank 0 only).

        Called on: all ranks.
        """
        if self._finished:
            return
        self._finished = True
        try:
            self._collect_pending()
        finally:
            errors = self._remover.wait() if self._remover else []
            if self._remover:
                self._remover.close()
        if errors:
            raise CheckpointError(
                f"deleting old checkpoints in '{self.save_folder}' failed ({errors[0]}); no "
                "checkpoint is torn (commit records go first), but some may remain: delete them "
                "by hand or let the next run's policy retry"
            ) from errors[0]

    @property
    def in_flight(self) -> Future[str] | None:
        """The future of the background save not yet waited for (None when there is none);
        it resolves to the committed path. Called on: any rank (its own save)."""
        return self._in_flight if self._pending is not None else None

    @property
    def last_saved_step(self) -> int | None:
        """Step of the newest checkpoint saved or being saved (None before the first)."""
        return self._last_saved

    @property
    def last_report(self) -> SaveReport | None:
        """Figures of the last committed save (phases, bytes, throughput; `.metrics()` for a
        dashboard), None before the first. Called on: any rank (its own part)."""
        return self.checkpointer.last_save_report

    # -- internals ------------------------------------------------------------------------------
    def _save(
        self,
        step: int,
        train_module: TrainModule,
        train_state: TrainState,
        kind: SaveKind,
        save_async: bool,
    ) -> str:
        if self._finished:
            raise CheckpointError(
                f"the CheckpointManager of '{self.save_folder}' is finished; no more saves"
            )
        if step in self._saved:
            log.info(
                "step %d is already saved (or being saved) at '%s'; not saving it again",
                step,
                self._saved[step],
            )
            return self._saved[step]
        self._collect_pending()
        state = train_state() if callable(train_state) else train_state
        if kind is SaveKind.LOCAL:
            return self._save_local(step, train_module, state)
        storage, folder = resolve(self.save_folder)
        path = storage.join(folder, layout.checkpoint_dirname(step, self.naming))
        ephemeral = kind is SaveKind.EPHEMERAL
        save = SaveEvent(step, path, kind, time.perf_counter())
        if save_async:
            future = self.checkpointer.save_async(
                path,
                train_module,
                state,
                ephemeral=ephemeral,
                overlap_staging=self.policy.overlap_staging,
            )
            log.info(
                "checkpoint event: saving %s '%s' in the background (training blocked %.2fs)",
                kind.value,
                path,
                time.perf_counter() - save.started,
            )
            self._pending = save
            self._in_flight = future
            future.add_done_callback(lambda f: on_done(save, f))
            self._after_commit(save, future)
        else:
            self.checkpointer.save(path, train_module, state, ephemeral=ephemeral)
            save.ended = time.perf_counter()
            self._after_commit(save, None)
        self._saved[step] = path
        self._last_saved = step
        return path

    def _save_local(self, step: int, train_module: TrainModule, state: dict[str, Any]) -> str:
        """Start a save of `step` to the node-local tier (always in the background); it is not
        a save-folder checkpoint, so retention and the step bookkeeping ignore it."""
        save = SaveEvent(step, "", SaveKind.LOCAL, time.perf_counter())
        future = self.checkpointer.save_local(step, train_module, state)
        save.path = str(Path(str(self.checkpointer.local_dir)) / f"step{step}")
        log.info(
            "checkpoint event: saving local '%s' in the background (training blocked %.2fs)",
            save.path,
            time.perf_counter() - save.started,
        )
        self._pending = save
        self._in_flight = future
        future.add_done_callback(lambda f: on_done(save, f))
        return save.path

    def _collect_pending(self) -> None:
        """Wait for the in-flight async save; turn its failure into a `CheckpointError`."""
        save, self._pending = self._pending, None
        if save is None:
            return
        try:
            self.checkpointer.wait()
        except CheckpointError as e:
            raise CheckpointError(
                f"the {save.kind.value} checkpoint of step {save.step} to '{save.path}' failed "
                f"({e}); nothing was deleted: the checkpoints already in "
                f"'{self.save_folder}' are kept. Fix the cause, then resume from the latest one"
            ) from e

    def _after_commit(self, save: SaveEvent, future: Future[str] | None) -> None:
        """Rank 0: once `save` is committed (`future` resolved, when async), log it and delete
        what the policy drops, on the retention thread. Queued now, so `finish()` waits for it."""
        if self._remover is None:
            return

        def log_commit() -> None:
            log_committed(save, (save.ended or time.perf_counter()) - save.started)

        self._remover.submit(before=log_commit, after=future)


def _committed_steps(folder: str) -> dict[int, str]:
    """Step -> path of every committed checkpoint in `folder` (none when it does not exist)."""
    try:
        return dict(find_checkpoints(*resolve(folder)))
    except FileNotFoundError:
        return {}
