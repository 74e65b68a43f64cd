"""The I/O side of retention: read what a save folder holds, and delete what a policy drops.

`scan_folder` turns a save folder into the infos `CheckpointPolicy` decides on (the `ephemeral`
flag read from each `.metadata.json`); `Remover` runs deletion rounds on a background thread so
training never waits for a deletion.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from trainckpt.checkpointer import Checkpointer
from trainckpt.core.commit import delete_leftover, is_committed
from trainckpt.errors import CheckpointError, ConcurrentSaveError
from trainckpt.format import finders, layout
from trainckpt.format.records import read_manifest
from trainckpt.retention.policy import CheckpointInfo, CheckpointPolicy, Leftover
from trainckpt.storage import resolve

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FolderState:
    """What a save folder holds: committed checkpoints (ascending by step) and leftovers of
    interrupted saves. Checkpoints whose commit record cannot be read are in neither list:
    retention never deletes what it cannot classify."""

    committed: list[CheckpointInfo]
    leftovers: list[Leftover]


class MetadataCache:
    """`ephemeral` flags of committed checkpoints by path; a commit record never changes
    while its folder exists, so each is read once. Thread-safe.

    A checkpoint counts only when both its records parse: one with a damaged manifest must not
    become the "newer checkpoint" that an older, intact one is deleted for."""

    def __init__(self) -> None:
        self._flags: dict[str, bool] = {}
        self._lock = threading.Lock()

    def ephemeral(self, path: str) -> bool:
        with self._lock:
            if path in self._flags:
                return self._flags[path]
        storage, ckpt = resolve(path)
        flag = finders.read_metadata(storage, ckpt).ephemeral
        try:
            read_manifest(storage, ckpt)
        except FileNotFoundError:
            pass  # written by OLMo-core: valid, only unverifiable
        with self._lock:
            self._flags[path] = flag
        return flag

    def forget(self, path: str) -> None:
        with self._lock:
            self._flags.pop(path, None)


def scan_folder(folder: str | os.PathLike, cache: MetadataCache | None = None) -> FolderState:
    """One listing of `folder`, one commit-record check per step folder and one metadata read
    per committed checkpoint not in `cache`. A missing folder holds nothing."""
    cache = cache or MetadataCache()
    storage, path = resolve(folder)
    try:
        names = storage.list_dir(path).dirs
    except FileNotFoundError:
        return FolderState([], [])
    committed: list[CheckpointInfo] = []
    leftovers: list[Leftover] = []
    for name in names:
        tmp = name.endswith(layout.TMP_SUFFIX)
        step = layout.parse_step(name[: -len(layout.TMP_SUFFIX)] if tmp else name)
        if step is None:
            continue
        full = storage.join(path, name)
        if tmp or not is_committed(storage, full):
            if not tmp and layout.is_torchtitan_name(name):
                continue  # written by torchtitan: not ours to delete
            leftovers.append(Leftover(step, full))
            continue
        try:
            committed.append(CheckpointInfo(step, full, cache.ephemeral(full)))
        except (CheckpointError, OSError) as e:
            log.warning("keeping '%s', not counted: its records cannot be read (%s)", full, e)
    committed.sort(key=lambda c: c.step)
    leftovers.sort(key=lambda x: x.step)
    return FolderState(committed, leftovers)


class Remover:
    """Runs deletion rounds one at a time on its own thread. Each round rescans the folder and
    deletes what the policy no longer keeps, commit record first (`Checkpointer.delete`).

    Called on: one rank (rank 0); the others never delete.
    """

    def __init__(self, folder: str, policy: CheckpointPolicy) -> None:
        self.folder = folder
        self.policy = policy
        self._cache = MetadataCache()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainckpt-retention")
        self._rounds: list[Future[list[str]]] = []
        self._lock = threading.Lock()

    def submit(
        self, before: Callable[[], None] | None = None, after: Future[Any] | None = None
    ) -> Future[list[str]]:
        """Queue a deletion round; its future holds the deleted paths or the round's error.

        With `after` (a save in flight), the round first waits on this thread for that save
        and is dropped if it failed: nothing is deleted unless its replacement is committed.
        `before` runs just before the deletions (e.g. logging the commit that triggered them).
        """

        def round_() -> list[str]:
            if after is not None and after.exception() is not None:
                return []
            if before is not None:
                before()
            try:
                return self.run_round()
            except Exception:
                log.exception("deleting old checkpoints in '%s' failed", self.folder)
                raise

        fut = self._executor.submit(round_)
        with self._lock:
            self._rounds.append(fut)
        return fut

    def run_round(self) -> list[str]:
        """Delete, in this thread, what the policy drops from the folder as it is now."""
        if self.policy.remove == "never":
            return []
        state = scan_folder(self.folder, self._cache)
        deleted: list[str] = []
        for ckpt in self.policy.to_delete(state.committed):
            kind = "ephemeral" if ckpt.ephemeral else "permanent"
            log.info(
                "checkpoint event: delete %s '%s' (no longer kept by the policy)", kind, ckpt.path
            )
            try:
                Checkpointer.delete(ckpt.path)
            except ConcurrentSaveError as e:  # a save_overwrite of this step holds its lock
                log.info("keeping '%s': %s", ckpt.path, e)
                continue
            self._cache.forget(ckpt.path)
            deleted.append(ckpt.path)
        storage, _ = resolve(self.folder)
        for left in self.policy.leftovers_to_delete(state.leftovers, state.committed):
            log.info("checkpoint event: delete leftover '%s' of an interrupted save", left.path)
            if delete_leftover(storage, left.path):
                deleted.append(left.path)
        return deleted

    def wait(self) -> list[BaseException]:
        """Wait for every queued round; return the errors of those that failed (once each)."""
        with self._lock:
            rounds, self._rounds = self._rounds, []
        errors: list[BaseException] = []
        for fut in rounds:
            err = fut.exception()
            if err is not None:
                errors.append(err)
        return errors

    def close(self) -> None:
        self._executor.shutdown(wait=True)
