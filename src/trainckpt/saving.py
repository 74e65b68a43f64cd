"""`Saving`: the save path of a `Checkpointer`: `save`, `save_async`, `save_files` and
`write_file`, and their steps (prepare and stage the state, build the `SaveRequest`, list what
each rank writes, keep the report). Called on: all ranks (see each method)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainckpt.background_saves import BackgroundSaves
from trainckpt.config import CheckpointerSettings
from trainckpt.core import dist, file_after_commit
from trainckpt.core.commit import SaveRequest, save_checkpoint
from trainckpt.core.gc_pause import paused_gc
from trainckpt.core.incremental import History
from trainckpt.core.rank_write import ListedFiles, TrainingFiles
from trainckpt.core.save_report import SavedPath, SaveReport, TimedFiles
from trainckpt.core.self_saving_module import saves_directly
from trainckpt.core.staging import Stager, StreamMark
from trainckpt.core.trainer_tensors import DeferredTrainerState
from trainckpt.core.trainer_tensors import prepare as prepare_trainer_state
from trainckpt.errors import ConfigurationError
from trainckpt.format import layout
from trainckpt.rollback import RollbackBookkeeping
from trainckpt.storage import StorageOptions, resolve
from trainckpt.train_module import TrainModule

if TYPE_CHECKING:  # imports DCP, which loads with the first save
    from trainckpt.core.writer_process import WriterProcess

log = logging.getLogger(__name__)


def default_threads() -> int:
    """Threads per rank writing or reading files when the settings give none: min(4, CPUs)."""
    return max(1, min(4, os.cpu_count() or 1))


class Saving(BackgroundSaves, RollbackBookkeeping):
    """The save path of a `Checkpointer` (a mix-in: the checkpointer sets these attributes)."""

    config: CheckpointerSettings
    process_group: dist.ProcessGroup | None
    last_save_report: SaveReport | None
    _storage_options: StorageOptions
    _stager: Stager
    _writer: WriterProcess | None
    _history: History
    work_dir: Path  # filled in by `with_defaults`, so typed without None (`Setting`s)
    save_overwrite: bool

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
                train_state, where, self.config.max_trainer_state_bytes, self._stager.cuda
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
        shared = self.config.async_writer == "process"
        if isinstance(trainer, bytes):
            return self._stager.stage(state, after=mark, shared=shared), trainer
        staged = self._stager.stage(trainer.with_tensors(state), after=mark, shared=shared)
        module_state, copies = DeferredTrainerState.split(staged)
        return module_state, trainer.serialize(copies)

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
            fs_timeout=self.config.fs_timeout,
            work_dir=self.work_dir,
            upload_threads=self._storage_options.thread_count,
            throttle_uploads=self.config.throttle_uploads,
            claim_lease=self.config.claim_lease,
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
        process = background and self.config.async_writer == "process"
        return TrainingFiles(
            trainer_state=trainer_bytes,
            model_state=state,
            direct_module=train_module if saves_directly(train_module) else None,
            dcp_dir=layout.dcp_dirname(req.storage.name(req.dir)),
            group=self.process_group,
            thread_count=self.config.save_thread_count or default_threads(),
            shard_writer=self._writer_process() if process else None,
            history=self._history if self.config.incremental else None,
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

    def _writer_process(self) -> WriterProcess:
        """The writer process of async saves (started with the first one that needs it).
        Called on: all ranks (save thread)."""
        from trainckpt.core.writer_process import WriterProcess, default_threads

        if self._writer is None:
            self._writer = WriterProcess()
        self._writer.threads = self.config.save_thread_count or default_threads()
        return self._writer

    def _unmap_staging(self) -> None:
        """The stager dropped its buffers: the writer process lets go of them too."""
        if self._writer is not None:
            self._writer.unmap_all()
