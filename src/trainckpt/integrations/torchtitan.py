"""trainckpt as torchtitan's checkpoint manager.

torchtitan 0.3 builds its checkpointer from `Trainer.Config.checkpoint`, typed as
`BaseCheckpointManager.Config`; pass `TorchtitanCheckpointManager.Config` there
(`CheckpointManager` is the same class under torchtitan's name) and the trainer calls this
manager (`load(step)`, `save(curr_step, last_step)`, `maybe_wait_for_staging()`, `close()`)
instead of its own. Built on trainckpt's public pieces: `ModelAndStates` (torchtitan's DCP
layout), `trainckpt.CheckpointManager` (the policy driver, not this class) with a
`CheckpointPolicy` (interval, retention, async saves, overlapped staging, model-only final save)
and `Checkpointer` (commit protocol, verification, object stores). docs/torchtitan.md says what
differs from torchtitan's own manager. Importing this module imports torchtitan.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Literal

from torchtitan.components.checkpointer.base import (
    DATALOADER,
    LR_SCHEDULER,
    OPTIMIZER,
    BaseCheckpointManager,
)

from trainckpt import manager
from trainckpt.checkpointer import Checkpointer, CheckpointerConfig
from trainckpt.core import dist
from trainckpt.errors import CheckpointNotFoundError, ConfigurationError, CorruptCheckpointError
from trainckpt.format import layout
from trainckpt.format.torchtitan_layout import (
    dcp_problems,
    rewritten_by_another_writer,
    torchtitan_checkpoints,
)
from trainckpt.model_states import ModelAndStates
from trainckpt.retention.policy import CheckpointPolicy
from trainckpt.storage import resolve

log = logging.getLogger(__name__)

AsyncModeName = Literal["disabled", "async", "async_with_pinned_mem"]


class TorchtitanCheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # untyped base
    """torchtitan's checkpoint manager contract, carried out by trainckpt.

    What differs from torchtitan's own manager (all on purpose, see docs/torchtitan.md): a
    save counts only once committed (a crash mid-save leaves no `step-N` that resumes);
    `load(-1)` skips a damaged newest checkpoint; loading an older step (`load_step`)
    abandons the newer ones (docs/rollback.md); `close()` commits a save in flight;
    `keep_latest_k` never deletes before the replacement is committed (so 1 is allowed), and
    never trims step 0 or the first-step checkpoint.

    Called on: all ranks (the trainer builds it on each).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        async_mode: AsyncModeName = "disabled"
        """`disabled`: blocking saves; `async`: staged in CPU memory, then written and
        committed in the background; `async_with_pinned_mem`: as `async`, and the copy to CPU
        memory also overlaps the next forward/backward (until `maybe_wait_for_staging`)."""

        naming: Literal["torchtitan", "trainckpt"] = "torchtitan"
        """Step folder names: `step-N` with DCP files at the top (torchtitan's own manager
        reads them), or trainckpt's `stepN/model_and_optim/` (OLMo-core reads them)."""

        verify_on_load: Literal["none", "size", "full"] = "size"
        """Check a checkpoint's files before loading it: sizes against the manifest (or, for one
        torchtitan wrote, against DCP's metadata), every CRC32C too (`full`), or nothing."""

        work_dir: str | None = None
        """Local scratch folder (staging of object-store uploads, download cache); default a
        folder under the system's temporary directory."""

        def __post_init__(self) -> None:
            keep: int = getattr(self, "keep_latest_k")  # noqa: B009 (mypy: field of the base)
            if keep == 1:  # torchtitan refuses 1 because it deletes before the next save lands
                setattr(self, "keep_latest_k", 2)  # noqa: B010
            try:
                BaseCheckpointManager.Config.__post_init__(self)
            finally:
                setattr(self, "keep_latest_k", keep)  # noqa: B010
            self.async_mode = self.async_mode.lower()  # type: ignore[assignment]  # as torchtitan
            if self.async_mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ConfigurationError(
                    f"Invalid async_mode: checkpoint.async_mode is '{self.async_mode}'; choose "
                    "disabled, async or async_with_pinned_mem (any case)"
                )
            if self.initial_load_in_hf_quantized:
                raise ConfigurationError(
                    "checkpoint.initial_load_in_hf_quantized is not supported by trainckpt's "
                    "manager; use torchtitan's own manager for quantized HF weights"
                )

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[Any],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any = None,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        if not self.enable:
            return
        self.config = config
        self.folder = (
            config.folder if "://" in config.folder else os.path.join(base_folder, config.folder)
        )
        self.sd_adapter = sd_adapter
        if (config.last_save_in_hf or config.initial_load_in_hf) and sd_adapter is None:
            raise ConfigurationError(
                "checkpoint.last_save_in_hf / initial_load_in_hf need the model's state-dict "
                "adapter (sd_adapter), and none was given"
            )
        self.states: dict[str, Any] = dict(states)
        self.states.update(
            {OPTIMIZER: optimizers, DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers}
        )
        unknown = [k for k in config.exclude_from_loading if k not in self.states]
        if unknown:
            raise ConfigurationError(
                f"checkpoint.exclude_from_loading names {unknown}, which are not among the "
                f"states {sorted(self.states)}"
            )
        self.module = ModelAndStates(model_parts, self.states, optim_keys=(OPTIMIZER,))
        self._load_module = ModelAndStates(
            model_parts,
            {k: v for k, v in self.states.items() if k not in config.exclude_from_loading},
            optim_keys=(OPTIMIZER,),
        )
        ckpt_config: dict[str, Any] = {"verify_on_load": config.verify_on_load}
        if config.work_dir:
            ckpt_config["work_dir"] = config.work_dir
        self.checkpointer: Checkpointer = CheckpointerConfig(**ckpt_config).build()
        model_only = config.last_save_model_only
        self.policy = CheckpointPolicy(
            save_interval=config.interval,
            fixed_steps=(1,)
            if config.enable_first_step_checkpoint and not config.load_only
            else (),
            max_checkpoints=config.keep_latest_k or None,
            pre_train_checkpoint=False,
            save_async=config.async_mode != "disabled",
            overlap_staging=config.async_mode == "async_with_pinned_mem",
            final_save="model_only" if model_only else "full",
            final_dtype=config.export_dtype if model_only else None,
        )
        self.driver = manager.CheckpointManager(
            self.checkpointer, self.policy, self.folder, naming=config.naming
        )
        log.info("trainckpt checkpointing active: loading from and saving to '%s'", self.folder)

    @property
    def save_future(self) -> Future[str] | None:
        """The background save not yet waited for, if any."""
        driver = getattr(self, "driver", None)
        return driver.in_flight if driver is not None else None

    def metrics(self) -> dict[str, float]:
        """The figures of the last save committed since the previous call (`SaveReport.metrics`:
        `checkpoint/blocked_s`, `checkpoint/writing_s`, ..., `checkpoint/bytes`), else {}: each
        save's figures are handed out once. Pass them to torchtitan's metrics, e.g.
        `metrics_processor.log(step, loss, max_loss, grad_norm, extra_metrics=ckpt.metrics())`,
        to see checkpoint cost on the dashboard beside loss and throughput. Called on: any rank
        (its own part)."""
        report = self.checkpointer.last_save_report
        if report is None or report is getattr(self, "_reported", None):
            return {}
        self._reported = report
        return report.metrics()

    # -- saving ---------------------------------------------------------------------------------
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if self.config.load_only:
            return False
        if last_step:
            if self.config.last_save_in_hf:
                from trainckpt.integrations.torchtitan_hf import save_hf  # imported on first use

                storage, folder = resolve(self.folder)
                name = layout.checkpoint_dirname(curr_step, self.config.naming)
                save_hf(
                    self.checkpointer,
                    storage.join(folder, name),
                    self.module.model_state(),
                    self.sd_adapter,
                    self.config.export_dtype,
                )
            else:
                self.driver.save_final(curr_step, self.module, {})
            return True
        return self.driver.maybe_save(curr_step, self.module, {}) is not None

    def _maybe_wait_for_staging(self) -> None:
        self.driver.wait_for_staging()

    def _wait_for_saving(self) -> None:
        self.checkpointer.wait()

    def _close(self) -> None:
        try:
            self.driver.finish()
        finally:
            self.checkpointer.close()

    # -- loading --------------------------------------------------------------------------------
    def _load(self, step: int = -1) -> bool:
        found = dist.run_on_rank0(
            lambda: self._find(step),
            f"finding the checkpoint to load in '{self.folder}'",
            self.checkpointer.process_group,
        )
        if found is None:
            loaded = self._initial_load()
            self.driver.start_from(None)  # the folder's trajectory starts here
            return loaded
        found_step, path, kind = found
        log.info("loading step %d from '%s'", found_step, path)
        if kind == "hf":
            self._load_hf(path)
        elif kind == "foreign":  # its files are not those the manifest records (`_find`)
            self._load_unverified(path, self._module_for(found_step))
        else:
            self.checkpointer.load(path, self._module_for(found_step), load_trainer_state=False)
        self.driver.start_from(found_step)  # newer steps are abandoned (docs/rollback.md)
        return True

    def _load_hf(self, path: str) -> None:
        """Load the Hugging Face safetensors of the local folder `path` into the model."""
        from trainckpt.integrations.torchtitan_hf import load_hf  # imported on first use

        module = self.module
        load_hf(
            path,
            module.model_state(),
            module.weights().load_state_dict,
            self.sd_adapter,
            self.checkpointer.process_group,
        )

    def _module_for(self, step: int) -> Any:
        """torchtitan's rule: a step-0 (seed) checkpoint restores the model only."""
        return self.module.weights() if step == 0 else self._load_module

    def _load_unverified(self, path: str, module: Any) -> None:
        """Load `path` without checking its files against the manifest (which another writer
        made stale); its DCP metadata is still read safely (`_find` checked its byte ranges)."""
        level = self.checkpointer.verify_on_load
        self.checkpointer.verify_on_load = "none"
        try:
            self.checkpointer.load(path, module, load_trainer_state=False)
        finally:
            self.checkpointer.verify_on_load = level

    def _candidates(self) -> dict[int, tuple[str, str]]:
        """step -> (path, kind) of every checkpoint in the folder: committed ones (either
        naming; `dcp` or `hf`) over torchtitan-written ones of the same step."""
        storage, folder = resolve(self.folder)
        try:
            found = {s: (p, "theirs") for s, p in torchtitan_checkpoints(storage, folder)}
            found.update({s: (p, "ours") for s, p in Checkpointer.find_checkpoints(folder)})
        except FileNotFoundError:
            return {}
        from trainckpt.integrations.torchtitan_hf import is_hf_checkpoint

        return {
            s: (p, "hf" if is_hf_checkpoint(storage, p) else kind) for s, (p, kind) in found.items()
        }

    def _find(self, step: int) -> tuple[int, str, str] | None:
        """Rank 0: the checkpoint to resume from, as (step, path, kind): `step`, or the newest
        that passes verification (damaged ones are skipped with a warning). None when the
        folder holds none; raises when `step` is missing or damaged, or all are damaged."""
        found = self._candidates()
        if step != -1 and step not in found:
            if not found and not self._folder_exists():
                raise CheckpointNotFoundError(
                    f"--checkpoint.load_step={step} not found because checkpoint.folder "
                    f"{self.folder} does not exist"
                )
            raise CheckpointNotFoundError(
                f"--checkpoint.load_step={step} not found in {self.folder} (steps there: "
                f"{sorted(found) or 'none'}); pick one of them or -1 for the latest"
            )
        order = [step] if step != -1 else sorted(found, reverse=True)
        skipped = []
        for s in order:
            path, kind = found[s]
            problems = self._problems(path, kind)
            if not problems:
                return s, path, "hf" if kind == "hf" else "dcp"
            foreign = rewritten_by_another_writer(*resolve(path)) if kind == "ours" else None
            if foreign is not None:
                log.warning(
                    "'%s' does not match trainckpt's manifest (%s), but %s. Loading it as an "
                    "unverified foreign checkpoint",
                    path,
                    "; ".join(problems),
                    foreign,
                )
                return s, path, "foreign"
            if step != -1:
                raise CorruptCheckpointError(
                    f"checkpoint.load_step={step}: '{path}' is damaged: {'; '.join(problems)}. "
                    "Load another step (-1 picks the newest good one)"
                )
            log.warning("skipping damaged checkpoint '%s': %s", path, "; ".join(problems))
            skipped.append(path)
        if skipped:
            raise CorruptCheckpointError(
                f"every checkpoint in '{self.folder}' is damaged ({', '.join(skipped)}); not "
                "starting from scratch over them: restore one from a copy or move them away"
            )
        return None

    def _folder_exists(self) -> bool:
        storage, folder = resolve(self.folder)
        try:
            storage.list_dir(folder)
        except FileNotFoundError:
            return False
        return True

    def _problems(self, path: str, kind: str) -> list[str]:
        level = self.config.verify_on_load
        if level == "none" or kind == "hf":
            return []
        if kind == "ours":
            return Checkpointer.verify(path, deep=level == "full").problems
        storage, folder = resolve(path)
        return dcp_problems(storage, folder)

    def _initial_load(self) -> bool:
        config = self.config
        path = config.initial_load_path
        if config.initial_load_in_hf:
            path = path or getattr(self.sd_adapter, "hf_assets_path", None)
            if not path:
                raise ConfigurationError(
                    "checkpoint.initial_load_in_hf needs checkpoint.initial_load_path or the "
                    "model's hf_assets_path"
                )

            log.info("initial load of Hugging Face weights from '%s'", path)
            self._load_hf(path)
            return True
        if not path:
            log.info("no checkpoint in '%s' and no initial_load_path: a fresh start", self.folder)
            return False
        module = self.module.weights() if config.initial_load_model_only else self._load_module
        log.info("initial load from '%s'", path)
        self.checkpointer.load(path, module, load_trainer_state=False)
        return True


CheckpointManager = TorchtitanCheckpointManager
"""The same class under torchtitan's own name, for drop-in imports."""
