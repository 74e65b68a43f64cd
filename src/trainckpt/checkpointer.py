"""`Checkpointer`: save, save_async and load of whole training checkpoints, and
`CheckpointerConfig`, its settings with `build()`; one module for the pair, as OLMo-core keeps
them, so `build()` needs no import back. The settings themselves are declared in `config.py`;
the save path (`saving.py`), the save thread (`background_saves.py`), rollback at resume
(`rollback.py`) and the finders (`finders.py`) are mix-ins of their own."""

from __future__ import annotations

import dataclasses
import difflib
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from trainckpt.config import CheckpointerSettings, Setting, default_work_dir
from trainckpt.core import dist, exit_guard
from trainckpt.core.incremental import History
from trainckpt.core.load import LoadRequest, VerifyOnLoad, load_checkpoint
from trainckpt.core.save_report import SaveReport
from trainckpt.core.staging import Stager
from trainckpt.errors import StorageError, UnknownSettingError
from trainckpt.finders import CheckpointFinders
from trainckpt.format import layout
from trainckpt.local.facade import LocalCheckpoints, SaveThread
from trainckpt.local.tier import LocalTier
from trainckpt.saving import Saving, default_threads
from trainckpt.storage import StorageOptions, resolve
from trainckpt.storage.local import writing
from trainckpt.train_module import TrainModule

if TYPE_CHECKING:  # imports DCP, which loads with the first save
    from trainckpt.core.writer_process import WriterProcess

__all__ = ["Checkpointer", "CheckpointerConfig", "default_work_dir"]


class CheckpointerConfig(CheckpointerSettings):
    """Settings of a `Checkpointer` (declared in `config.CheckpointerSettings`), and `build()`.
    Unknown keys are refused, so a typo cannot pass silently."""

    def build(
        self, process_group: dist.ProcessGroup | None = None, **overrides: Any
    ) -> Checkpointer:
        """A `Checkpointer` with these settings, `overrides` applied (and validated) on top;
        settings left None take the `Checkpointer`'s defaults.

        Called on: all ranks (the checkpointer may create its own process group).
        """
        settings = self.updated(**overrides).model_dump(exclude_none=True)
        return Checkpointer(process_group=process_group, **settings)


@dataclass(init=False)
class Checkpointer(Saving, CheckpointFinders):
    """Saves and loads checkpoints of a training run. Build one per run, on every rank, with
    `CheckpointerConfig.build()`; its methods are then called on all ranks together.

    In a multi-rank job it runs its own collectives on `process_group`, a gloo group it creates
    when none is given (creating it is collective: construct the Checkpointer on all ranks).

    Its settings are `CheckpointerConfig`'s fields: constructor keywords, validated there, held
    in `config`, and read and written as typed attributes of the same names (`ckpt.work_dir`).
    """

    METADATA_FNAME: ClassVar[str] = layout.METADATA_FILE

    # The settings as typed attributes (`Setting`); a test checks they are the config's fields.
    work_dir = Setting[Path]()
    save_overwrite = Setting[bool]()
    pre_download = Setting[bool]()
    save_thread_count = Setting[int | None]()
    async_writer = Setting[Literal["thread", "process"]]()
    incremental = Setting[bool]()
    load_thread_count = Setting[int | None]()
    throttle_uploads = Setting[bool]()
    fs_timeout = Setting[float]()
    collective_timeout = Setting[float]()
    retry_deadline = Setting[float]()
    claim_lease = Setting[float]()
    on_rollback = Setting[Literal["replace", "refuse"]]()
    local_dir = Setting[Path | None]()
    replication_factor = Setting[int]()
    replication_jump = Setting[int | None]()
    local_keep = Setting[int]()
    verify_on_load = Setting[VerifyOnLoad]()
    max_trainer_state_bytes = Setting[int]()
    exit_timeout = Setting[float]()

    config: CheckpointerConfig
    """The settings, validated, with `work_dir` and `save_overwrite` filled in if left None."""
    process_group: dist.ProcessGroup | None
    last_save_report: SaveReport | None
    """Figures of the last committed `save`/`save_async` (`save_report.py`); also on the
    path they return: `ckpt.save(...).report`, `ckpt.save_async(...).result().report`."""

    def __init__(self, *, process_group: dist.ProcessGroup | None = None, **settings: Any) -> None:
        """`settings`: `CheckpointerConfig`'s fields by name; an invalid one raises
        `ConfigurationError` naming it. Called on: all ranks (it may create a process group)."""
        self.config = CheckpointerConfig.validated(settings, "Checkpointer").with_defaults()
        self.process_group = process_group
        if self.work_dir.exists() and not self.work_dir.is_dir():
            raise StorageError(
                f"work_dir '{self.work_dir}' is a file, not a folder; set work_dir to a folder "
                "on the local disk (it holds staging files and downloads)"
            )
        with writing(self.work_dir):  # a raw OSError here would name no setting
            self.work_dir.mkdir(parents=True, exist_ok=True)
        self._own_group: dist.ProcessGroup | None = None
        self._destroy_own_group: Callable[[], Any] = lambda: None
        if self.process_group is None:
            self.process_group = self._own_group = dist.new_cpu_group(self.collective_timeout)
            if self._own_group is not None:  # destroyed also if this object is dropped unclosed
                self._destroy_own_group = weakref.finalize(
                    self, dist.destroy_group, self._own_group
                )
        else:
            dist.check_cpu_group(self.process_group)
        self._storage_options = StorageOptions(
            thread_count=self.save_thread_count or 8, retry_deadline=self.retry_deadline
        )
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainckpt-save")
        self._pending = None
        self._pending_dir = ""
        self._staging = None
        self._stager = Stager(on_release=self._unmap_staging)
        self.last_save_report = None
        self._writer: WriterProcess | None = None
        if self.async_writer == "process":
            self._writer_process().start()  # its start-up overlaps the trainer's
        self._lock = threading.Lock()
        self._history = History()
        """This rank's record of its last committed save, for incremental saves."""
        if self.config.incremental:  # async saves skip copying unchanged large tensors
            self._stager.digests = self._history.digests
        self._loaded = None
        """(storage, folder, step) of the last checkpoint loaded, until the next save."""
        exit_guard.track(self)  # its own group is destroyed at exit if close() is not called
        self._local = (
            None
            if self.local_dir is None
            else LocalTier(
                Path(self.local_dir),
                self.process_group,
                replication_factor=self.replication_factor,
                replication_jump=self.replication_jump,
                keep=self.local_keep,
            )
        )

    if not TYPE_CHECKING:  # type checkers, not seeing these, refuse unknown names themselves

        def __getattr__(self, name: str) -> Any:
            """Reached only for a name the checkpointer lacks: refused, naming the setting."""
            raise _unknown_attribute(self, name)

        def __setattr__(self, name: str, value: Any) -> None:
            """A public name the class does not declare is refused: a misspelt setting
            (`ckpt.wrok_dir = ...`) would otherwise be stored and never used."""
            if not (name.startswith("_") or hasattr(type(self), name) or name in _DECLARED):
                raise _unknown_attribute(self, name)
            super().__setattr__(name, value)

    # -- closing (saving: `saving.py`; the save thread: `background_saves.py`) ---------------
    def close(self) -> None:
        """Wait for the in-flight save, raise its error if it failed, and stop the worker."""
        try:
            self._finish_pending()
        finally:
            self._executor.shutdown(wait=True)
            if self._local is not None:
                self._local.close()  # its deletions after the last local save
            if self._writer is not None:
                self._writer.close()
            self._stager.release()
            self._release_own_group()

    def _release_own_group(self) -> None:
        """Destroy the gloo group this checkpointer created and drop every reference to it, so
        its worker threads stop now. Left to interpreter exit, a worker thread still releasing
        a finished collective's tensors aborts the process ("terminate called without an active
        exception"). A group the caller passed in stays the caller's. Called on: all ranks, by
        `close()`, or at exit by `exit_guard` when the process never called it."""
        if self._own_group is None:
            return
        self._destroy_own_group()  # runs once (weakref.finalize)
        self._own_group = self.process_group = None
        self._local = None

    # -- loading --------------------------------------------------------------------------------
    def load(
        self,
        dir: str | os.PathLike[str],
        train_module: TrainModule,
        *,
        load_trainer_state: bool | None = None,
        load_optim_state: bool | None = None,
        reset_optimizer_states_on_load: bool | None = None,
        exclude: Sequence[str] = (),
    ) -> dict[str, Any] | None:
        """Load a checkpoint (local path or URL) into `train_module`; return this rank's
        trainer state, rank 0's when the world size changed, or None when not asked for or
        (with `load_trainer_state=None`) absent. A bare DCP folder loads too.

        `exclude` names top-level keys to leave untouched: of the module state (`"model"`,
        `"optim"`) or of the trainer state (left out of the returned dict); an unknown name is
        an error listing the known ones. A step-0 (seed) checkpoint loads model weights only
        unless `load_optim_state=True`.

        A module with OLMo-core's direct API (`load_state_dict_direct`) loads the DCP folder
        itself, with the keywords OLMo-core's Checkpointer passes; `reset_optimizer_states_on_load`
        (keep the weights, drop the optimizer moments) is passed to it, and when None defaults,
        on a resume (trainer state found), to the module's `reset_optimizer_states_on_resume`.
        Other modules have no such reset, as in OLMo-core: True is ignored with a warning.

        Called on: all ranks.
        """
        self._finish_pending()
        storage, path = resolve(dir, self._storage_options)
        req = LoadRequest(
            storage=storage,
            dir=path,
            group=self.process_group,
            verify=self.verify_on_load,
            work_dir=self.work_dir,
            pre_download=self.pre_download,
            thread_count=self.load_thread_count or default_threads(),
            max_trainer_state_bytes=self.max_trainer_state_bytes,
            cuda=self._stager.cuda,
        )
        state = load_checkpoint(
            req,
            train_module,
            load_trainer_state=load_trainer_state,
            load_optim_state=load_optim_state,
            reset_optimizer_states_on_load=reset_optimizer_states_on_load,
            exclude=exclude,
        )
        step = layout.parse_step(storage.name(path))
        self._loaded = None if step is None else (storage, storage.parent(path), step)
        return state

    # -- the node-local tier (docs/design.md §9, docs/local-tier.md) ----------------------------
    @property
    def local(self) -> LocalCheckpoints:
        """The node-local tier: `ckpt.local.save(step, train_module, train_state)`,
        `.latest()`, `.load(step, train_module)`, `.load_latest(train_module)` (see
        `LocalCheckpoints`). Without `local_dir` each of them raises `ConfigurationError`.
        A local save shares this checkpointer's save thread: one save runs at a time."""
        return LocalCheckpoints(
            self._local,
            self.process_group,
            SaveThread(
                finish_pending=self._finish_pending,
                stage=self._prepare_staged,
                submit=self._in_background,
            ),
        )

    def save_local(
        self, step: int, train_module: TrainModule, train_state: dict[str, Any]
    ) -> Future[str]:
        """Alias of `local.save` (the name the local tier first shipped with)."""
        return self.local.save(step, train_module, train_state)

    def latest_local(self) -> int | None:
        """Alias of `local.latest`."""
        return self.local.latest()

    def load_local(self, step: int, train_module: TrainModule) -> dict[str, Any] | None:
        """Alias of `local.load`."""
        return self.local.load(step, train_module)

    def load_latest_local(self, train_module: TrainModule) -> tuple[int, dict[str, Any]] | None:
        """Alias of `local.load_latest`."""
        return self.local.load_latest(train_module)


_DECLARED = frozenset(f.name for f in dataclasses.fields(Checkpointer))


def _unknown_attribute(ckpt: Checkpointer, name: str) -> UnknownSettingError:
    """The error for an attribute `ckpt` does not have, with the setting meant if one is close."""
    close = difflib.get_close_matches(name, [*CheckpointerConfig.model_fields, *dir(ckpt)], n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return UnknownSettingError(
        f"'{type(ckpt).__name__}' object has no attribute '{name}'{hint} (its settings are "
        "CheckpointerConfig's fields)"
    )
