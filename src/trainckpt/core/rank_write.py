"""What every rank writes in a save: step "every rank writes its files" of the commit protocol
(`commit.py`), which calls `write` once per rank and never calls back into `Checkpointer`.

A training checkpoint (`TrainingFiles`): each rank writes its trainer state, all ranks agree that
every one did (fault point `writing-shards` follows), then the ranks write the model state as one
DCP folder (or a module with OLMo-core's direct API writes it). `save_files` checkpoints
(`ListedFiles`): rank 0 runs a function that writes the files, the others write nothing.

Where a rank writes is a `WriteTarget`: the save's `-tmp` folder on a filesystem (each file
fsynced), or a staging folder on the local disk whose files the protocol uploads (not fsynced:
the uploaded objects are the copies that must last).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from trainckpt.core import dist
from trainckpt.core.self_saving_module import save_direct
from trainckpt.errors import CheckpointError, ConfigurationError, StorageError
from trainckpt.format import layout
from trainckpt.storage.checksummed_file import checksummed_file
from trainckpt.storage.checksums import FileEntry, crc32c_file
from trainckpt.storage.local import fsync_dir, writing
from trainckpt.testing.faults import fault_point

if TYPE_CHECKING:  # imports DCP, which loads with the first save (`import trainckpt` stays fast)
    from trainckpt.core.incremental import History, Reuse
    from trainckpt.format.shard_writer import ShardWriter

OnFile = Callable[[str], None]
"""Gets the path of each file (relative to the checkpoint) as soon as it is complete, from any
thread: the protocol starts its upload."""


@dataclass(frozen=True)
class WriteTarget:
    """Where and how one rank writes its files of a save."""

    folder: Path
    """A local folder that stands for the checkpoint folder (`-tmp`, or a staging folder)."""
    durable: bool
    """Fsync each file: true where the files stay (`-tmp`), false for staging copies."""
    upload_threads: int = 0
    """Parallel uploads that will take the files from a staging folder; 0 when none will."""
    on_file: OnFile | None = None
    reuse: Reuse | None = None
    """Where files taken over from the previous checkpoint go; None: every file is written."""


class RankFiles(Protocol):
    """The files one rank contributes to a save."""

    def write(self, to: WriteTarget) -> dict[str, FileEntry]:
        """Write this rank's files under `to.folder`; return them (path relative to the
        checkpoint -> size and CRC32C). Called on: all ranks; runs collectives on the save's
        group."""
        ...


@dataclass(frozen=True)
class TrainingFiles:
    """A training checkpoint: this rank's serialized trainer state and its part of the model
    state (a state dict, or a module that writes its DCP folder itself)."""

    trainer_state: bytes
    model_state: dict[str, Any]
    """The (staged) state dict to write with DCP; empty when `direct_module` writes it."""
    direct_module: Any | None
    """A module with OLMo-core's direct API (`self_saving_module.py`), or None."""
    dcp_dir: str
    """The DCP folder inside the checkpoint (`layout.dcp_dirname`); "" for the folder itself."""
    group: dist.ProcessGroup | None
    thread_count: int
    """Shard files (and writer threads) per rank when writing in place."""
    shard_writer: ShardWriter | None = None
    """Who writes the shard files (`save_async` with a writer process); None: threads."""
    history: History | None = None
    """This rank's record of its previous save, for an incremental save; None: not one."""

    def write(self, to: WriteTarget) -> dict[str, FileEntry]:
        """Called on: all ranks (DCP plans collectively)."""
        from trainckpt.core.dcp import save_state  # imported on first use: DCP takes ~1 s
        from trainckpt.core.incremental import Session

        # 0. An incremental save starts hashing the state's large tensors now (`incremental.py`).
        prefix = f"{self.dcp_dir}/" if self.dcp_dir else ""
        session = (
            None
            if self.history is None or to.reuse is None or self.direct_module is not None
            else Session(self.history, to.reuse, prefix, self.model_state)
        )

        # 1. The trainer state. Every rank learns whether every rank wrote its own: a rank
        #    that failed would otherwise leave the others waiting in DCP's collectives.
        rel = layout.trainer_state_file(dist.get_rank(self.group))
        error: Exception | None = None
        entries: dict[str, FileEntry] = {}
        try:
            entries[rel] = _write_file(to, rel, self.trainer_state)
        except Exception as e:
            error = e
        dist.agree(error, f"writing trainer state under '{to.folder}'", self.group)
        if to.on_file is not None:
            to.on_file(rel)
        fault_point("writing-shards")

        # 2. The model state, as DCP shards. Staged for an upload: at least one shard file per
        #    upload thread, so that every upload thread has a file to send.
        shards = max(self.thread_count, to.upload_threads)
        model_dir = to.folder / self.dcp_dir if self.dcp_dir else to.folder
        if self.direct_module is not None:
            entries.update(
                save_direct(
                    self.direct_module,
                    model_dir,
                    prefix,
                    group=self.group,
                    thread_count=shards,
                    durable=to.durable,
                )
            )
        else:
            entries.update(
                save_state(
                    self.model_state,
                    model_dir,
                    group=self.group,
                    thread_count=shards,
                    durable=to.durable,
                    on_file=to.on_file,
                    prefix=prefix,
                    shard_writer=self.shard_writer,
                    incremental=session,
                )
            )
        return entries


@dataclass(frozen=True)
class ListedFiles:
    """Files that `write_files(folder)` writes on rank 0 and returns (paths relative to the
    folder), e.g. safetensors shards and their index (`Checkpointer.save_files`)."""

    write_files: Callable[[Path], list[str]]
    dir: str
    """The checkpoint being saved, named in errors."""
    group: dist.ProcessGroup | None

    def write(self, to: WriteTarget) -> dict[str, FileEntry]:
        """Called on: all ranks; `write_files` runs on rank 0 only."""
        error: Exception | None = None
        entries: dict[str, FileEntry] = {}
        try:
            if dist.get_rank(self.group) == 0:
                for rel in self.write_files(to.folder):
                    if not layout.is_safe_relpath(rel):
                        raise ConfigurationError(
                            f"save_files: '{rel}' is not a path inside '{self.dir}'"
                        )
                    if to.durable:
                        with open(to.folder / rel, "rb") as f:
                            os.fsync(f.fileno())
                    entries[rel] = crc32c_file(to.folder / rel)
                    if to.on_file is not None:
                        to.on_file(rel)
        except CheckpointError as e:
            error = e
        except Exception as e:
            error = StorageError(
                f"writing the files of checkpoint '{self.dir}' failed ({type(e).__name__}: "
                f"{e}); nothing was committed: fix the cause and save again"
            )
            error.__cause__ = e
        dist.agree(error, f"writing the files of '{self.dir}'", self.group)
        return entries


def _write_file(to: WriteTarget, rel: str, data: bytes) -> FileEntry:
    """Create `rel` under `to.folder` holding `data`; fsynced with its folder when durable."""
    path = to.folder / rel
    with writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
    with checksummed_file(path, fsync=to.durable) as f:
        f.write(data)
    if to.durable:
        with writing(path):
            fsync_dir(path.parent)
    return f.entry()
