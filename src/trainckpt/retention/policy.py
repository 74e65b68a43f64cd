"""`CheckpointPolicy`: when to save, and which checkpoints to keep. Pure decisions, no I/O.

Orbax-style: checkpoint infos in, decisions out, so every rule is testable without a disk.
Whether a checkpoint is ephemeral comes from its `.metadata.json` (the caller reads it into
`CheckpointInfo.ephemeral`), never from its step number, so changing the intervals between runs
cannot turn a permanent checkpoint into a deletable one.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trainckpt.errors import settings_error

RemovalStrategy = Literal["ephemeral_only", "all_non_permanent", "never"]


class SaveKind(str, Enum):
    """What a save decision asks for."""

    PERMANENT = "permanent"
    EPHEMERAL = "ephemeral"
    LOCAL = "local"
    """A save to the node-local tier (`Checkpointer.save_local`), not to the save folder."""


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as retention sees it: its step, path, and the `ephemeral` flag
    read from its `.metadata.json`."""

    step: int
    path: str
    ephemeral: bool


@dataclass(frozen=True)
class Leftover:
    """A step folder that is not a committed checkpoint: a `stepN` without `.metadata.json`
    or a `stepN-tmp` working folder, both left by an interrupted save or deletion."""

    step: int
    path: str


class CheckpointPolicy(BaseModel):
    """When to save checkpoints, which kind, and which old ones to delete.

    The trainer reports every finished step; `decide(step, ...)` says whether to save a
    permanent checkpoint, an ephemeral one, or none. `to_delete(...)` says which committed
    checkpoints the policy no longer keeps. Invalid combinations are refused with a message
    naming the fields.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    save_interval: int | None = Field(default=None, ge=1)
    """Save a permanent checkpoint every this many steps (None: only fixed steps, step 0 and
    whatever the trainer saves explicitly)."""
    ephemeral_save_interval: int | None = Field(default=None, ge=1)
    """Save an ephemeral checkpoint every this many steps; it is deleted once a newer checkpoint
    of either kind is committed. Must be less than `save_interval`. For preemptible jobs."""
    local_save_interval: int | None = Field(default=None, ge=1)
    """Save to the node-local tier (`local_dir`, `save_local`) every this many steps, at steps
    that get no save-folder checkpoint. Needs a checkpointer with `local_dir`."""
    fixed_steps: tuple[int, ...] = ()
    """Extra steps that get a permanent checkpoint; never trimmed by `max_checkpoints`."""
    max_checkpoints: int | None = Field(default=None, ge=1)
    """Permanent checkpoints to keep, counting those already in the save folder from earlier
    runs; the oldest beyond it are deleted. Step 0 and `fixed_steps` are neither counted nor
    trimmed. None keeps all."""
    ephemeral_cooldown: int = Field(default=0, ge=0)
    """Skip an ephemeral save when the last checkpoint is fewer than this many steps old."""
    pre_train_checkpoint: bool = True
    """Save a permanent checkpoint at step 0, before training (skipped when step 0 is
    already committed, e.g. on resume)."""
    remove: RemovalStrategy = "ephemeral_only"
    """What gets deleted: `ephemeral_only` deletes superseded ephemeral checkpoints (and trims
    permanent ones to `max_checkpoints`); `all_non_permanent` also deletes leftovers of
    interrupted saves (step folders without `.metadata.json`, stale `-tmp` folders) older than
    the newest checkpoint; `never` deletes nothing."""
    save_async: bool = True
    """Write checkpoints in the background after staging them in CPU memory."""
    overlap_staging: bool = False
    """With `save_async`: return from a save before the copy to CPU memory is done, so the copy
    overlaps the next forward/backward; the trainer then calls
    `CheckpointManager.wait_for_staging()` before its optimizer step (torchtitan's
    `maybe_wait_for_staging`)."""
    final_save: Literal["full", "model_only"] = "full"
    """What the final checkpoint of a run holds (`CheckpointManager.save_final`): everything, or
    the model weights only (smaller; for evaluation and release, not for resuming training)."""
    final_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """With `final_save: model_only`, cast floating-point weights to this dtype (None keeps
    them as they are)."""

    @model_validator(mode="after")
    def _check_combination(self) -> CheckpointPolicy:
        if (
            self.save_interval is not None
            and self.ephemeral_save_interval is not None
            and self.ephemeral_save_interval >= self.save_interval
        ):
            raise ValueError(
                f"ephemeral_save_interval ({self.ephemeral_save_interval}) must be less than "
                f"save_interval ({self.save_interval}); ephemeral checkpoints are the frequent "
                "ones. Lower ephemeral_save_interval or raise save_interval"
            )
        if self.max_checkpoints is not None and self.remove == "never":
            raise ValueError(
                f"max_checkpoints={self.max_checkpoints} cannot be honoured with "
                "remove='never'; set max_checkpoints to null or choose another remove"
            )
        if self.ephemeral_cooldown and self.ephemeral_save_interval is None:
            raise ValueError(
                f"ephemeral_cooldown={self.ephemeral_cooldown} has no effect without "
                "ephemeral_save_interval; set ephemeral_save_interval or drop ephemeral_cooldown"
            )
        if self.final_dtype is not None and self.final_save != "model_only":
            raise ValueError(
                f"final_dtype={self.final_dtype} applies only to final_save='model_only' "
                f"(final_save is '{self.final_save}'); set final_save or drop final_dtype"
            )
        if self.overlap_staging and not self.save_async:
            raise ValueError(
                "overlap_staging=True applies only to background saves (save_async is false); "
                "set save_async: true or drop overlap_staging"
            )
        if any(s < 0 for s in self.fixed_steps):
            raise ValueError(f"fixed_steps must be steps >= 0, got {list(self.fixed_steps)}")
        return self

    @classmethod
    def validated(cls, raw: dict[str, Any], where: str = "CheckpointPolicy") -> CheckpointPolicy:
        """Validate `raw`, turning pydantic's errors into one `ConfigurationError` naming each
        field (e.g. the `policy:` section of a config file)."""
        try:
            return cls.model_validate(raw)
        except ValidationError as e:
            raise settings_error(e, where, "checkpoint policy") from e

    # -- saving ---------------------------------------------------------------------------------
    def decide(self, step: int, last_saved_step: int | None) -> SaveKind | None:
        """What to save after `step` finished, given the step of the newest checkpoint (None
        when there is none). Depends only on its arguments, so every rank decides alike."""
        if step == 0:
            return SaveKind.PERMANENT if self.pre_train_checkpoint else None
        if step in self.fixed_steps:
            return SaveKind.PERMANENT
        if self.save_interval is not None and step % self.save_interval == 0:
            return SaveKind.PERMANENT
        if self.ephemeral_save_interval is not None and step % self.ephemeral_save_interval == 0:
            cooling = (
                last_saved_step is not None and step - last_saved_step < self.ephemeral_cooldown
            )
            if not cooling:
                return SaveKind.EPHEMERAL
        if self.local_save_interval is not None and step % self.local_save_interval == 0:
            return SaveKind.LOCAL
        return None

    # -- retention ------------------------------------------------------------------------------
    def to_delete(self, committed: Iterable[CheckpointInfo]) -> list[CheckpointInfo]:
        """The committed checkpoints this policy no longer keeps, oldest first.

        `committed` must hold only committed checkpoints (so each replacement is already
        durable). Never returns the newest one. Ephemeral checkpoints go once a newer checkpoint
        exists; permanent ones beyond the newest `max_checkpoints` go, except step 0 and
        `fixed_steps`.
        """
        ckpts = sorted(committed, key=lambda c: c.step)
        if self.remove == "never" or len(ckpts) < 2:
            return []
        newest = ckpts[-1].step
        doomed = [c for c in ckpts if c.ephemeral and c.step < newest]
        if self.max_checkpoints is not None:
            trimmable = [
                c
                for c in ckpts
                if not c.ephemeral and c.step != 0 and c.step not in self.fixed_steps
            ]
            doomed += trimmable[: max(0, len(trimmable) - self.max_checkpoints)]
        return sorted((c for c in doomed if c.step != newest), key=lambda c: c.step)

    def leftovers_to_delete(
        self, leftovers: Iterable[Leftover], committed: Sequence[CheckpointInfo]
    ) -> list[Leftover]:
        """Leftovers of interrupted saves to delete (`all_non_permanent` only): those older
        than the newest committed checkpoint. A newer one may be a save still in flight, so
        it stays; the next save of that step clears it anyway."""
        if self.remove != "all_non_permanent" or not committed:
            return []
        newest = max(c.step for c in committed)
        return sorted((x for x in leftovers if x.step < newest), key=lambda x: x.step)
