"""The I/O side of retention: delete what a policy drops from a save folder.

Each round reads the folder through `format.folder` (`step_states`: committed checkpoints with
the `ephemeral` flag of their `.metadata.json`, and leftovers of interrupted saves), turns it into
the infos `CheckpointPolicy` decides on, and deletes, commit record first. `Remover` runs the
rounds on a background thread so training never waits for a deletion.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from trainckpt.core.commit import delete_checkpoint, delete_leftover
from trainckpt.errors import ConcurrentSaveError
from trainckpt.format.folder import Records, read_records, step_states
from trainckpt.retention.policy import CheckpointInfo, CheckpointPolicy, Leftover
from trainckpt.storage import Storage, resolve

log = logging.getLogger(__name__)


class RecordsCache:
    """The commit records of committed checkpoints by path, for `folder.step_states`: a commit
    record never changes while its folder exists, so each is read once. Kept only when both
    records read cleanly (a damaged checkpoint is read again next round), and without the
    manifest, which can be megabytes. Thread-safe."""

    def __init__(self) -> None:
        self._records: dict[str, Records] = {}
        self._lock = threading.Lock()

    def read(self, storage: Storage, path: str) -> Records:
        with self._lock:
            if path in self._records:
                return self._records[path]
        records = read_records(storage, path)
        if records.metadata is not None and not records.problems:
            with self._lock:
                self._records[path] = Records(records.metadata)
        return records

    def forget(self, path: str) -> None:
        with self._lock:
            self._records.pop(path, None)


class Remover:
    """Runs deletion rounds one at a time on its own thread. Each round rescans the folder and
    deletes what the policy no longer keeps, commit record first (`commit.delete_checkpoint`).

    Called on: one rank (rank 0); the others never delete.
    """

    def __init__(self, folder: str, policy: CheckpointPolicy) -> None:
        self.folder = folder
        self.policy = policy
        self._cache = RecordsCache()
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
        storage, path = resolve(self.folder)
        committed: list[CheckpointInfo] = []
        leftovers: list[Leftover] = []
        for f, state, records in step_states(storage, path, self._cache.read):
            if state == "committed":
                assert records.metadata is not None
                committed.append(CheckpointInfo(f.step, f.path, records.metadata.ephemeral))
            elif state == "damaged":  # retention never deletes what it cannot classify
                why = "; ".join(records.problems) or "its commit record is gone"
                log.warning(
                    "keeping '%s', not counted: its records cannot be read (%s)", f.path, why
                )
            else:
                leftovers.append(Leftover(f.step, f.path))
        deleted: list[str] = []
        for ckpt in self.policy.to_delete(committed):
            kind = "ephemeral" if ckpt.ephemeral else "permanent"
            log.info(
                "checkpoint event: delete %s '%s' (no longer kept by the policy)", kind, ckpt.path
            )
            try:
                delete_checkpoint(storage, ckpt.path)
            except ConcurrentSaveError as e:  # a save_overwrite of this step holds its lock
                log.info("keeping '%s': %s", ckpt.path, e)
                continue
            self._cache.forget(ckpt.path)
            deleted.append(ckpt.path)
        for left in self.policy.leftovers_to_delete(leftovers, committed):
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
