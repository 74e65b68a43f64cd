"""`Checkpointer`: save, save_async and load of whole training checkpoints, and
`CheckpointerConfig`, its settings; one module for the pair, as OLMo-core keeps them, so the
config's `build()` needs no import back. The finding and inspection classmethods delegate to
`format.folder` and `format.verify`."""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, Literal, TypeVar, cast, overload

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainckpt.core import dist, exit_guard, file_after_commit
from trainckpt.core.claim import DEFAULT_LEASE, MAX_LEASE
from trainckpt.core.commit import SaveRequest, delete_checkpoint, save_checkpoint
from trainckpt.core.futures import CallbacksFirstFuture
from trainckpt.core.gc_pause import paused_gc
from trainckpt.core.incremental import History
from trainckpt.core.load import LoadRequest, VerifyOnLoad, load_checkpoint
from trainckpt.core.rank_write import ListedFiles, TrainingFiles
from trainckpt.core.save_report import SavedPath, SaveReport, TimedFiles
from trainckpt.core.self_saving_module import saves_directly
from trainckpt.core.staging import Stager, StreamMark
from trainckpt.core.trainer_tensors import DeferredTrainerState
from trainckpt.core.trainer_tensors import prepare as prepare_trainer_state
from trainckpt.errors import (
    CheckpointError,
    ConfigurationError,
    StorageError,
    UnknownSettingError,
    settings_error,
)
from trainckpt.format import folder as save_folder
from trainckpt.format import layout
from trainckpt.format.records import CheckpointMetadata
from trainckpt.format.trainer_state import DEFAULT_MAX_BYTES
from trainckpt.format.verify import (
    Progress,
    VerifyReport,
    newest_good,
    verify_checkpoint,
)
from trainckpt.local.facade import LocalCheckpoints, SaveThread
from trainckpt.local.tier import LocalTier
from trainckpt.storage import Storage, StorageOptions, resolve
from trainckpt.storage.local import writing
from trainckpt.train_module import TrainModule

if TYPE_CHECKING:  # imports DCP, which loads with the first save
    from trainckpt.core.writer_process import WriterProcess

log = logging.getLogger(__name__)


def default_work_dir() -> Path:
    """`<tmp>/trainckpt-<uid>`: the `work_dir` of a `Checkpointer` given none."""
    return Path(tempfile.gettempdir()) / f"trainckpt-{os.getuid() if hasattr(os, 'getuid') else 0}"


def _config_error(error: ValidationError, where: str) -> ConfigurationError:
    """pydantic's complaint as a `ConfigurationError` naming each field; a misspelt field gets
    the closest real one ("did you mean 'work_dir'?")."""
    fields = list(CheckpointerConfig.model_fields)
    hints = [
        f"'{close[0]}' for '{err['loc'][0]}'"
        for err in error.errors()
        if err["type"] == "extra_forbidden" and err["loc"]
        for close in [difflib.get_close_matches(str(err["loc"][0]), fields, n=1)]
        if close
    ]
    message = str(settings_error(error, where, "checkpointer settings"))
    if hints:
        message += f" (did you mean {', '.join(hints)}?)"
    return ConfigurationError(message)


class CheckpointerConfig(BaseModel):
    """Settings of a `Checkpointer`. Unknown keys are refused, so a typo cannot pass silently.

    The one place the settings, their defaults and their limits are declared: a `Checkpointer`
    holds its validated settings as an instance of this class (`Checkpointer.config`).
    """

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True
    )

    work_dir: Path | None = None
    """Node-local scratch folder: staging of uploads to object stores and the cache of files
    downloaded from URLs. Not the save folder. None: OLMo-core's `TrainerConfig.build` sets its
    trainer's `work_dir`; otherwise `<tmp>/trainckpt-<uid>`."""
    save_overwrite: bool | None = None
    """Replace a committed checkpoint of the same step instead of refusing to save. None:
    OLMo-core's `TrainerConfig.build` sets its trainer's `save_overwrite`; otherwise False."""
    pre_download: bool = False
    """When loading from a URL, download the files this rank needs before reading them, instead
    of reading byte ranges on demand."""
    save_thread_count: int | None = Field(default=None, ge=1, le=64)
    """Threads per rank writing files, and uploading them to object stores; None picks
    min(4, CPUs) for writing and 8 for uploads (which wait on the network, not the CPU)."""
    async_writer: Literal["thread", "process"] = "thread"
    """Who writes the files of `save_async`: threads of the training process, or a separate
    writer process that reads the staged state from shared memory, so the writing never
    competes with training for the interpreter lock (docs/performance.md). The process costs
    a Python interpreter with torch (started at the first async save) and stages into shared
    memory (a `memfd`, not `/dev/shm`); its threads: `save_thread_count`, or the cores
    training leaves free."""
    incremental: bool = True
    """Incremental saves (docs/incremental.md): items whose bytes (xxh3-128 hash) did not change
    since this checkpointer's previous save fill files of their own, and such a file is taken
    over by a hard link (local/NFS) or a server-side copy (gs://, s3://) instead of being
    written and uploaded again. Every checkpoint stays complete and loads alone. False: every
    save writes every byte."""
    load_thread_count: int | None = Field(default=None, ge=1, le=64)
    """Threads per rank reading (and downloading) files; None picks min(4, CPUs)."""
    throttle_uploads: bool = False
    """Upload to object stores one rank per node at a time, to spare each node's network.
    Ranks on the same host take turns in ascending rank order (the host's first rank uploads
    all its files, then its second, ...); each turn ends with a barrier on the checkpointer's
    process group, so nodes upload in parallel but never two ranks of one node. A turn must
    fit within `collective_timeout`. Local/NFS saves ignore it."""
    fs_timeout: float = Field(default=120.0, gt=0)
    """Seconds to wait for files and folders written by another rank to become visible
    (shared filesystems lag) before failing with an error saying what was awaited."""
    collective_timeout: float = Field(default=600.0, gt=0)
    """Seconds a collective of the checkpointer's own process group may wait for a peer; a rank
    that died during a save makes the others fail after at most this long."""
    retry_deadline: float = Field(default=300.0, gt=0)
    """Seconds a remote storage request may keep retrying transient errors."""
    claim_lease: float = Field(default=DEFAULT_LEASE, gt=0, le=MAX_LEASE)
    """Object stores: seconds a save's claim on its step stays live without renewal. Rank 0
    renews it six times per period while the save runs; another save of the same step that
    sees it renewed fails at once, and one that sees it unchanged for this long (its save
    crashed) takes the step over. So a save after a crash waits up to this long; a save that
    stalls for longer than this loses its step and fails instead of committing."""
    on_rollback: Literal["replace", "refuse"] = "replace"
    """What a run that resumes from an older step than the newest committed one in its save
    folder does with the newer checkpoints (docs/rollback.md): `replace` abandons them (no
    finder reports them again; the run's saves of those steps replace them); `refuse` raises
    an error naming them instead, and abandons nothing."""
    local_dir: Path | None = None
    """Folder of the node-local tier (`save_local`): on each node's own disk (NVMe,
    `/dev/shm`), the same path on every node. None: no local tier."""
    replication_factor: int = Field(default=2, ge=1, le=16)
    """Copies of each rank's local part, its own included, each on another node."""
    replication_jump: int | None = Field(default=None, ge=1)
    """Ranks between a local part and its replica; None: the ranks per node
    (`LOCAL_WORLD_SIZE`), so replicas land on the next node."""
    local_keep: int = Field(default=2, ge=1)
    """Committed steps the local tier keeps."""
    verify_on_load: VerifyOnLoad = "size"
    """Check files against the manifest before loading: none, size (cheap) or full (CRC32C)."""
    max_trainer_state_bytes: int = Field(default=DEFAULT_MAX_BYTES, ge=1)
    """Largest trainer-state file (`train/rank{R}.pt`) a save writes and a load reads: a larger
    one is refused by its size before it is read (docs/limits.md). Default 1 GiB."""
    exit_timeout: float = Field(default=300.0, ge=0)
    """Seconds a process that ends (or gets SIGTERM, where the trainer has no handler of its
    own) without `close()` waits for its in-flight async save to commit; a save that does not
    commit in time is logged as an ERROR naming it. 0 does not wait."""

    # -- every way in raises `ConfigurationError` naming the field, never pydantic's own error --
    def __init__(self, **settings: Any) -> None:
        """`CheckpointerConfig(work_dir=..., ...)`; an unknown or invalid field raises
        `ConfigurationError` naming it."""
        try:
            super().__init__(**settings)
        except ValidationError as e:
            raise _config_error(e, type(self).__name__) from e

    # pydantic runs a custom __init__ inside model_validate and would wrap our error in its own;
    # this one only translates errors, so validation may skip it (as it skips BaseModel's)
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise _config_error(e, type(self).__name__) from e

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> CheckpointerConfig:
        """pydantic's `model_validate`, raising `ConfigurationError` naming each bad field."""
        return cls.validated(obj, cls.__name__, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: Any, **kwargs: Any) -> CheckpointerConfig:
        """pydantic's `model_validate_json`, raising `ConfigurationError` naming each bad field."""
        try:
            return super().model_validate_json(json_data, **kwargs)
        except ValidationError as e:
            raise _config_error(e, cls.__name__) from e

    @classmethod
    def from_file(cls, path: str | Path) -> CheckpointerConfig:
        """Read a YAML or JSON file (a top-level `checkpointer:` key is accepted too)."""
        p = Path(path)
        try:
            text = p.read_text()
        except FileNotFoundError as e:
            raise ConfigurationError(f"config file '{p}' does not exist") from e
        try:
            raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ConfigurationError(f"config file '{p}' is not valid YAML/JSON: {e}") from e
        raw = raw or {}
        if not isinstance(raw, dict):
            raise ConfigurationError(f"config file '{p}' must hold a mapping of settings")
        if "checkpointer" in raw and isinstance(raw["checkpointer"], dict):
            raw = raw["checkpointer"]
        return cls.validated(raw, where=str(p))

    @classmethod
    def validated(
        cls, raw: Any, where: str = "CheckpointerConfig", **kwargs: Any
    ) -> CheckpointerConfig:
        """Validate `raw`, turning pydantic's errors into one message that names each field
        (`where`: the file or caller the settings came from)."""
        try:
            return super().model_validate(raw, **kwargs)
        except ValidationError as e:
            raise _config_error(e, where) from e

    def updated(self, where: str = "CheckpointerConfig", **changes: Any) -> CheckpointerConfig:
        """A copy with `changes` applied and validated (`where` names the caller in errors)."""
        return self.validated({**self.model_dump(), **changes}, where) if changes else self

    def with_defaults(self) -> CheckpointerConfig:
        """A copy with the settings a trainer may fill in, if left None, set to their defaults:
        `work_dir` `<tmp>/trainckpt-<uid>`, `save_overwrite` False."""
        return self.model_copy(
            update={
                "work_dir": default_work_dir() if self.work_dir is None else self.work_dir,
                "save_overwrite": bool(self.save_overwrite),
            }
        )

    def build(
        self, process_group: dist.ProcessGroup | None = None, **overrides: Any
    ) -> Checkpointer:
        """A `Checkpointer` with these settings, `overrides` applied (and validated) on top;
        settings left None take the `Checkpointer`'s defaults.

        Called on: all ranks (the checkpointer may create its own process group).
        """
        settings = self.updated(**overrides).model_dump(exclude_none=True)
        return Checkpointer(process_group=process_group, **settings)


_T = TypeVar("_T")


class _Setting(Generic[_T]):
    """A setting of a `Checkpointer` as a typed attribute: read from its `config`, and written
    into a new `config` validated by `CheckpointerConfig` (an invalid value raises
    `ConfigurationError` naming it). Values that the checkpointer derived at construction
    (its process group, storage options, local tier) stay as they were."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> _Setting[_T]: ...
    @overload
    def __get__(self, obj: Checkpointer, owner: type) -> _T: ...
    def __get__(self, obj: Checkpointer | None, owner: type) -> _Setting[_T] | _T:
        if obj is None:
            return self
        return cast(_T, getattr(obj.config, self.name))

    def __set__(self, obj: Checkpointer, value: _T) -> None:
        changed = obj.config.updated("Checkpointer", **{self.name: value})
        obj.config = changed.with_defaults()


def _failed(target: str, error: Exception) -> CheckpointError:
    """An unexpected error of the async save of `target`, as a `CheckpointError` naming it."""
    failed = CheckpointError(
        f"the async save of '{target}' failed ({type(error).__name__}: {error}); nothing of "
        "it was committed: fix the cause and save again"
    )
    failed.__cause__ = error
    return failed


def _default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


@dataclass(init=False)
class Checkpointer:
    """Saves and loads checkpoints of a training run. Build one per run, on every rank, with
    `CheckpointerConfig.build()`; its methods are then called on all ranks together.

    In a multi-rank job it runs its own collectives on `process_group`, a gloo group it creates
    when none is given (creating it is collective: construct the Checkpointer on all ranks).

    Its settings are `CheckpointerConfig`'s fields: constructor keywords, validated there, held
    in `config`, and read and written as typed attributes of the same names (`ckpt.work_dir`).
    """

    METADATA_FNAME: ClassVar[str] = layout.METADATA_FILE

    # The settings as typed attributes (`_Setting`); a test checks they are the config's fields.
    work_dir = _Setting[Path]()
    save_overwrite = _Setting[bool]()
    pre_download = _Setting[bool]()
    save_thread_count = _Setting[int | None]()
    async_writer = _Setting[Literal["thread", "process"]]()
    incremental = _Setting[bool]()
    load_thread_count = _Setting[int | None]()
    throttle_uploads = _Setting[bool]()
    fs_timeout = _Setting[float]()
    collective_timeout = _Setting[float]()
    retry_deadline = _Setting[float]()
    claim_lease = _Setting[float]()
    on_rollback = _Setting[Literal["replace", "refuse"]]()
    local_dir = _Setting[Path | None]()
    replication_factor = _Setting[int]()
    replication_jump = _Setting[int | None]()
    local_keep = _Setting[int]()
    verify_on_load = _Setting[VerifyOnLoad]()
    max_trainer_state_bytes = _Setting[int]()
    exit_timeout = _Setting[float]()

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
        self._pending: CallbacksFirstFuture[str] | None = None
        self._pending_dir = ""
        self._staging: Future[None] | None = None
        self._stager = Stager(on_release=self._unmap_staging)
        self.last_save_report = None
        self._writer: WriterProcess | None = None
        if self.async_writer == "process":
            self._writer_process().start()  # its start-up overlaps the trainer's
        self._lock = threading.Lock()
        self._history = History()
        """This rank's record of its last committed save, for incremental saves."""
        self._loaded: tuple[Storage, str, int] | None = None
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

    # -- saving ---------------------------------------------------------------------------------
    def save(
        self,
        dir: str | os.PathLike[str],
        train_module: TrainModule,
        train_state: dict[str, Any],
        *,
        ephemeral: bool = False,
    ) -> str:
        """Save and commit a checkpoint; return its path. Blocks until committed.

        Called on: all ranks.
        """
        self._finish_pending()
        start = time.perf_counter()
        req = self._request(dir, ephemeral)
        trainer, state = self._prepare(req.dir, train_module, train_state, stage=False)
        assert isinstance(trainer, bytes)  # serialized at once when not deferred
        trainer_bytes = trainer
        self._stager.wait_for_trainer(state)  # the writer threads read GPU state on their streams
        files = TimedFiles(self._training_files(req, train_module, trainer_bytes, state))
        path = self._committed(req, save_checkpoint(req, files))
        return self._saved(files.report(path, start, staged=start))

    def save_async(
        self,
        dir: str | os.PathLike[str],
        train_module: TrainModule,
        train_state: dict[str, Any],
        *,
        ephemeral: bool = False,
        overlap_staging: bool = False,
    ) -> Future[str]:
        """Stage the state in CPU memory, then write and commit it in the background.

        Returns once staged: the caller may change parameters and trainer state right away.
        With `overlap_staging=True` it returns before the copy to CPU memory is done (the copy
        overlaps the next forward/backward); the caller must then call `wait_for_staging()`
        before the next optimizer step changes parameters (the next `save`, `save_async` and
        `load` wait for it too). The trainer state is checked and copied during the call either
        way; its GPU tensors, if any, are staged with the module's (docs/gpu.md).

        The future resolves to the committed path only after the commit; until then no finder
        reports the checkpoint. One save runs at a time: this call first waits for the previous
        one (and raises its error, if it failed). Staging reuses one CPU copy of the state.

        A process that ends without `close()` (returns, raises, `sys.exit`, SIGTERM with its
        default action) first waits up to `exit_timeout` seconds for the save to commit, or
        logs an ERROR naming it (`exit_guard`).

        A train module that saves itself (OLMo-core's direct API) cannot be staged and is
        refused, as OLMo-core refuses it: use `save`.

        Called on: all ranks.
        """
        if saves_directly(train_module):
            raise ConfigurationError(
                f"cannot save '{dir}' asynchronously: {type(train_module).__name__} writes its "
                "state itself (save_state_dict_direct), so it cannot be staged; use save() "
                "(with OLMo-core's CheckpointerCallback: save_async=False)"
            )
        self._finish_pending()
        start = time.perf_counter()
        req = self._request(dir, ephemeral)
        trainer, state = self._prepare(
            req.dir, train_module, train_state, stage=not overlap_staging, defer=True
        )
        prepared = time.perf_counter()  # the call returns now: training is unblocked
        to_stage = state if isinstance(trainer, bytes) else trainer.with_tensors(state)
        mark = self._stager.mark(to_stage) if overlap_staging else None  # GPU state as of now
        staging: Future[None] = Future()
        if not overlap_staging:
            staging.set_result(None)
            log.info(
                "staged checkpoint '%s' in %.2fs; writing in the background",
                req.dir,
                time.perf_counter() - start,
            )

        def run() -> str:
            staged, trainer_bytes = state, trainer
            if overlap_staging:
                staged, trainer_bytes = self._stage_in_background(
                    req, state, trainer, staging, mark
                )
            assert isinstance(trainer_bytes, bytes)
            staged_at = time.perf_counter() if overlap_staging else prepared
            files = TimedFiles(
                self._training_files(req, train_module, trainer_bytes, staged, background=True)
            )
            path = self._committed(req, save_checkpoint(req, files))
            return self._saved(files.report(path, start, staged_at, prepared))

        return self._in_background(req.dir, run, staging)

    def _in_background(
        self, target: str, run: Callable[[], str], staging: Future[None]
    ) -> Future[str]:
        """Run `run` (the write and commit of a staged save of `target`) on the save thread;
        return the future of its result, which waiters see only after the caller's
        done-callbacks ran (see `futures.py`). Called on: all ranks (training thread)."""
        committed: CallbacksFirstFuture[str] = CallbacksFirstFuture()

        def run_and_resolve() -> None:
            try:
                path = run()
            except Exception as e:
                committed.fail(e if isinstance(e, CheckpointError) else _failed(target, e))
            except BaseException as e:
                committed.fail(e)
            else:
                committed.resolve(path)

        with self._lock:
            self._staging = staging
            self._pending_dir = target
            self._pending = committed
            self._executor.submit(run_and_resolve)
            exit_guard.watch(self)
            return committed

    def in_flight(self) -> tuple[str, Future[str]] | None:
        """The target and future of the async save not waited for yet, if any: a failed one
        whose error its future already handed out is not (read without the lock: the exit
        hooks call it, possibly while the main thread holds the lock)."""
        pending = self._pending
        if pending is None or pending.error_seen:
            return None
        return self._pending_dir, pending

    def save_files(
        self,
        dir: str | os.PathLike[str],
        write_files: Callable[[Path], list[str]],
        *,
        ephemeral: bool = False,
    ) -> str:
        """Save and commit a checkpoint made of the files `write_files(folder)` writes into a
        local folder and returns (paths relative to it), e.g. safetensors shards and their
        index: the same commit protocol, manifest and checks as `save`, so no finder reports
        it before it is complete. Blocks until committed; returns its path.

        Called on: all ranks; `write_files` runs on rank 0 only (the others write nothing).
        """
        self._finish_pending()
        start = time.perf_counter()
        req = self._request(dir, ephemeral)
        files = TimedFiles(ListedFiles(write_files, req.dir, self.process_group))
        return self._saved(files.report(save_checkpoint(req, files), start, staged=start))

    def wait_for_staging(self) -> None:
        """Block until the state of the last `save_async(..., overlap_staging=True)` is copied
        to CPU memory; call it before the optimizer step that follows that save. Returns at
        once when nothing is being staged. Raises if staging failed."""
        with self._lock:
            staging = self._staging
        if staging is not None:
            staging.result()

    def _writer_process(self) -> WriterProcess:
        """The writer process of async saves (started with the first one that needs it).
        Called on: all ranks (save thread)."""
        from trainckpt.core.writer_process import WriterProcess, default_threads

        if self._writer is None:
            self._writer = WriterProcess()
        self._writer.threads = self.save_thread_count or default_threads()
        return self._writer

    def _unmap_staging(self) -> None:
        """The stager dropped its buffers: the writer process lets go of them too."""
        if self._writer is not None:
            self._writer.unmap_all()

    def _stage_in_background(
        self,
        req: SaveRequest,
        state: dict[str, Any],
        trainer: bytes | DeferredTrainerState,
        done: Future[None],
        mark: StreamMark | None,
    ) -> tuple[dict[str, Any], bytes]:
        """Copy `state` (and the trainer state's GPU tensors) to CPU buffers off the training
        thread (after the training stream's `mark`, on a GPU) and signal `done` once the copies
        are complete; every rank learns whether every rank staged. Returns the staged state and
        the trainer-state file's bytes. Called on: all ranks (background thread)."""
        error: Exception | None = None
        staged: tuple[dict[str, Any], bytes] = ({}, b"")
        start = time.perf_counter()
        try:
            staged = self._stage(state, trainer, mark)
        except Exception as e:
            error = e
        if error is None:
            done.set_result(None)
            log.info(
                "staged checkpoint '%s' in %.2fs (overlapped)", req.dir, time.perf_counter() - start
            )
        else:
            done.set_exception(error)
        dist.agree(error, f"staging the save of '{req.dir}'", self.process_group)
        return staged

    def write_file(self, dir: str | os.PathLike[str], fname: str, contents: str | bytes) -> str:
        """Write one file into a folder, atomically; refused if it exists, unless
        `save_overwrite`. Returns its path. Into a committed checkpoint (OLMo-core's
        `ConfigSaverCallback` writes `config.json` into each), the file is added to its
        manifest too, so the checkpoint still verifies. Called on: whichever ranks want to
        write it (one at a time per checkpoint)."""
        storage, folder = resolve(dir, self._storage_options)
        data = contents.encode() if isinstance(contents, str) else contents
        return file_after_commit.write_file(
            storage, folder, fname, data, overwrite=self.save_overwrite
        )

    def wait(self) -> str | None:
        """Wait for the in-flight async save, if any; return its path or raise its error."""
        return self._finish_pending()

    def close(self) -> None:
        """Wait for the in-flight save, raise its error if it failed, and stop the worker."""
        try:
            self._finish_pending()
        finally:
            self._executor.shutdown(wait=True)
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

    def _finish_pending(self) -> str | None:
        """Wait for the async save not waited for yet; return its path, or raise its error
        as it is (its own type) unless its future already handed it out: an error is raised
        once. Called on: all ranks (training thread)."""
        with self._lock:
            pending, target, self._pending = self._pending, self._pending_dir, None
        if pending is None:
            return None
        try:
            return pending.result_once()
        except Exception as e:
            e.add_note(f"(raised by the next checkpointer call: the async save of '{target}')")
            raise

    def _prepare(
        self,
        where: str,
        train_module: TrainModule,
        train_state: dict[str, Any],
        *,
        stage: bool,
        defer: bool = False,
    ) -> tuple[bytes | DeferredTrainerState, dict[str, Any]]:
        """Serialize the trainer state and collect (and, for async saves, stage) the model
        state; a module that saves itself (direct API) is asked for nothing here. A trainer
        state with GPU tensors is staged with the model state (`trainer_tensors.py`); with
        `defer` and not `stage`, it is returned unserialized, for `_stage` to finish. Every rank
        learns whether every rank succeeded: a rank that failed here and left would otherwise
        leave its peers waiting in the first collective of the save.

        Called on: all ranks.
        """
        error: Exception | None = None
        trainer: bytes | DeferredTrainerState = b""
        state: dict[str, Any] = {}
        try:
            trainer = prepare_trainer_state(
                train_state, where, self.max_trainer_state_bytes, self._stager.cuda
            )
            if not saves_directly(train_module):
                with paused_gc():  # thousands of entries: see core/gc_pause.py
                    state = train_module.state_dict_to_save()
            if stage:  # complete (GPU copies too) when it returns
                state, trainer = self._stage(state, trainer)
            elif not defer and not isinstance(trainer, bytes):  # a save(): read on this thread
                trainer = trainer.serialize(trainer.tensors)
        except Exception as e:
            error = e
        dist.agree(error, f"preparing the save of '{where}'", self.process_group)
        return trainer, state

    def _prepare_staged(
        self, where: str, train_module: TrainModule, train_state: dict[str, Any]
    ) -> tuple[bytes, dict[str, Any]]:
        """`_prepare` with staging, for the local tier: the trainer state comes back serialized
        (its GPU tensors staged with the model state). Called on: all ranks."""
        trainer, state = self._prepare(where, train_module, train_state, stage=True)
        assert isinstance(trainer, bytes)  # staged, then serialized
        return trainer, state

    def _stage(
        self,
        state: dict[str, Any],
        trainer: bytes | DeferredTrainerState,
        mark: StreamMark | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        """Stage `state` and the trainer state's GPU tensors together (after `mark`); return
        the staged state and the trainer-state file's bytes, serialized from the CPU copies.
        Called on: all ranks (the thread that stages)."""
        shared = self.async_writer == "process"
        if isinstance(trainer, bytes):
            return self._stager.stage(state, after=mark, shared=shared), trainer
        staged = self._stager.stage(trainer.with_tensors(state), after=mark, shared=shared)
        module_state, copies = DeferredTrainerState.split(staged)
        return module_state, trainer.serialize(copies)

    def _request(self, dir: str | os.PathLike[str], ephemeral: bool) -> SaveRequest:
        storage, path = resolve(dir, self._storage_options)
        if not storage.writable:
            raise ConfigurationError(f"cannot save to '{path}': that storage is read-only")
        self._abandon_after_rollback(storage, storage.parent(path))
        return SaveRequest(
            storage=storage,
            dir=path,
            step=layout.parse_step(storage.name(path)),
            ephemeral=ephemeral,
            overwrite=self.save_overwrite,
            group=self.process_group,
            fs_timeout=self.fs_timeout,
            work_dir=self.work_dir,
            upload_threads=self._storage_options.thread_count,
            throttle_uploads=self.throttle_uploads,
            claim_lease=self.claim_lease,
        )

    def _training_files(
        self,
        req: SaveRequest,
        train_module: TrainModule,
        trainer_bytes: bytes,
        state: dict[str, Any],
        *,
        background: bool = False,
    ) -> TrainingFiles:
        """What each rank writes for a save of `train_module` (`rank_write.py`); a `background`
        (async) save's shards go through the writer process when `async_writer="process"`."""
        process = background and self.async_writer == "process"
        return TrainingFiles(
            trainer_state=trainer_bytes,
            model_state=state,
            direct_module=train_module if saves_directly(train_module) else None,
            dcp_dir=layout.dcp_dirname(req.storage.name(req.dir)),
            group=self.process_group,
            thread_count=self.save_thread_count or _default_threads(),
            shard_writer=self._writer_process() if process else None,
            history=self._history if self.incremental else None,
        )

    def _committed(self, req: SaveRequest, path: str) -> str:
        """The training save of `req` committed as `path`: the next incremental save compares
        with it. Called on: all ranks, on the thread that ran the save."""
        self._history.committed(req.storage, path)
        return path

    def _saved(self, saved: SavedPath) -> SavedPath:
        """Keep and log the report of a committed save (`last_save_report`). Called on: all
        ranks, on the thread that ran the save."""
        r = self.last_save_report = saved.report
        log.info(
            "committed checkpoint '%s' in %.2fs (training blocked %.2fs; staging %.2fs, writing "
            "%.2fs, commit %.2fs; this rank %d files, %.1f MB, %.0f MB/s)",
            saved,
            r.total,
            r.blocked,
            r.staging,
            r.writing,
            r.commit,
            r.files,
            r.bytes / 1e6,
            r.throughput / 1e6,
        )
        return saved

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
            thread_count=self.load_thread_count or _default_threads(),
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

    def resume_into(self, save_folder: str | os.PathLike[str]) -> list[int]:
        """Say that the run trains on from the checkpoint loaded last and saves into
        `save_folder`. When that checkpoint is a step of `save_folder` and newer ones are
        committed there, they are abandoned now (docs/rollback.md) instead of at the first
        save, so a crash before that save cannot resume from them. A load for evaluation must
        not call this; loading another folder's checkpoint abandons nothing. Returns the
        abandoned steps. Called on: all ranks."""
        storage, folder = resolve(save_folder, self._storage_options)
        return self._abandon_after_rollback(storage, folder)

    def _abandon_after_rollback(self, storage: Storage, folder: str) -> list[int]:
        """At `resume_into`, or else before the first save after a load: when the run saves
        into the folder the loaded checkpoint came from, it resumed there, and that folder's
        checkpoints newer than the loaded one are abandoned (docs/design.md §11,
        `folder.abandon_newer`), so no finder reports them again and this run's saves of those
        steps replace them. (OLMo-core's Trainer loads and saves through this class;
        `CheckpointManager` abandons them already at resume.) Called on: all ranks."""
        loaded, self._loaded = self._loaded, None
        if loaded is None or type(loaded[0]) is not type(storage) or folder != loaded[1]:
            return []
        step = loaded[2]
        abandoned = dist.run_on_rank0(
            lambda: save_folder.abandon_newer(
                storage, folder, step, refuse=self.on_rollback == "refuse"
            ),
            f"abandoning the checkpoints newer than step {step} in '{folder}'",
            self.process_group,
        )
        return [s for s, _ in abandoned]

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

    # -- finding --------------------------------------------------------------------------------
    @classmethod
    def checkpoint_dirname(cls, step: int) -> str:
        return layout.checkpoint_dirname(step)

    @classmethod
    def dir_is_checkpoint(cls, dir: str | os.PathLike[str]) -> bool:
        """True for a committed checkpoint or a bare DCP folder (model weights only)."""
        return save_folder.is_checkpoint(*resolve(dir))

    @classmethod
    def find_checkpoints(
        cls, dir: str | os.PathLike[str], ephemeral: bool | None = None
    ) -> Iterator[tuple[int, str]]:
        """Committed checkpoints directly under `dir`, as (step, path), ascending by step.

        One listing of `dir`, then one request per step folder: an existence check of its
        commit record, or, with the `ephemeral` filter, a read of it (a missing one means not
        committed). `-tmp` folders and folders without a commit record are skipped.
        """
        yield from save_folder.find_checkpoints(*resolve(dir), ephemeral)

    @classmethod
    def contains_checkpoint(cls, dir: str | os.PathLike[str]) -> bool:
        """True when `dir` is a checkpoint or holds at least one."""
        return save_folder.contains_checkpoint(*resolve(dir))

    @classmethod
    def latest_checkpoint(cls, dir: str | os.PathLike[str]) -> str:
        """Path of the committed checkpoint with the highest step under `dir`.

        Probes step folders from the newest down and stops at the first committed one.
        Raises `CheckpointNotFoundError` (a `FileNotFoundError`) when there is none.
        """
        return save_folder.latest_checkpoint(*resolve(dir))

    @classmethod
    def delete(cls, dir: str | os.PathLike[str]) -> None:
        """Delete a checkpoint folder (committed or not, or a `-tmp` working folder): the
        commit record first, so a crash midway leaves an uncommitted folder that no finder
        reports, never a torn checkpoint. A missing folder is ignored; a symbolic link loses
        only the link. On a filesystem, the folders of a save still running are refused with
        `ConcurrentSaveError` (those of a crashed save are deleted). Called on: one rank."""
        delete_checkpoint(*resolve(dir))

    @classmethod
    def verify(
        cls, dir: str | os.PathLike[str], *, deep: bool = False, progress: Progress | None = None
    ) -> VerifyReport:
        """Check a checkpoint's files against its manifest: missing, resized or unexpected
        files and escaping manifest entries; with `deep`, the CRC32C of every byte. `progress`
        receives byte counts as they are checked. A checkpoint without a manifest (OLMo-core's)
        is reported ok but `unverifiable`. Raises `CheckpointNotFoundError` for a path that is
        no folder. Called on: any one process."""
        return verify_checkpoint(*resolve(dir), deep=deep, progress=progress)

    def find_latest_good(self, dir: str | os.PathLike[str]) -> str | None:
        """The newest committed checkpoint under `dir` that passes verification (sizes, or
        every CRC32C with `verify_on_load="full"`), or None when there is none (or no `dir`).

        Rank 0 checks from the newest down; each one that fails is skipped with a warning
        naming it and the reason. Every rank gets rank 0's answer, so all load the same one.
        Called on: all ranks.
        """
        deep = self.verify_on_load == "full"
        return dist.run_on_rank0(
            lambda: newest_good(*resolve(dir, self._storage_options), deep=deep),
            f"finding the newest good checkpoint in '{dir}'",
            self.process_group,
        )

    @classmethod
    def read_metadata(cls, dir: str | os.PathLike[str]) -> CheckpointMetadata:
        """The commit record of a checkpoint."""
        return save_folder.read_metadata(*resolve(dir))


_DECLARED = frozenset(f.name for f in dataclasses.fields(Checkpointer))


def _unknown_attribute(ckpt: Checkpointer, name: str) -> UnknownSettingError:
    """The error for an attribute `ckpt` does not have, with the setting meant if one is close."""
    close = difflib.get_close_matches(name, [*CheckpointerConfig.model_fields, *dir(ckpt)], n=1)
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return UnknownSettingError(
        f"'{type(ckpt).__name__}' object has no attribute '{name}'{hint} (its settings are "
        "CheckpointerConfig's fields)"
    )
