"""What the local tier keeps on a disk: leftovers of crashed saves deleted, and after each
commit the `keep` newest steps the job can restore, commit markers deleted first (on a thread of
its own, `start_retention`: deleting a step is not part of committing the next). Called on: one
rank per disk."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

from trainckpt.local.layout import scan, step_dirs
from trainckpt.storage.local import fsync_dir
from trainckpt.testing.faults import fault_point

log = logging.getLogger(__name__)


def clean_leftovers(root: Path) -> None:
    """Delete what crashed saves left on this disk (it counts for nothing)."""
    for item in scan(root)[1]:
        log.info("local tier: deleting '%s' (%s)", item.path, item.why)
        _remove_quietly(item.path)
    _remove_empty_steps(root)


def start_retention(
    root: Path, committed: int, restorable: set[int], keep: int
) -> threading.Thread:
    """Run `retain` on a thread of its own (started; join it before the disk is read or
    written again, and before the process exits). An unexpected error is logged: it only
    costs space."""

    def run() -> None:
        try:
            retain(root, committed, restorable, keep)
        except Exception as e:
            log.warning(
                "local tier: retention after step %d under '%s' failed: %s", committed, root, e
            )

    thread = threading.Thread(target=run, name="trainckpt-local-retention", daemon=False)
    thread.start()
    return thread


def retain(root: Path, committed: int, restorable: set[int], keep: int) -> None:
    """Keep the step just committed and the `keep - 1` newest other steps that the job can
    restore (`restorable`: every rank's part has a copy the coverage vote counts, the same
    test a restore uses); delete the rest, commit markers first (a crash midway leaves
    parts that no longer count, never a step that counts but is incomplete). A step that
    lost a part is deleted and never displaces an older restorable one. Called on: one
    rank per disk, after a save committed on every rank (`start_retention`)."""
    for item in scan(root)[1]:  # what failed saves of older steps left
        if item.step < committed:
            log.info("local tier: deleting '%s' (%s)", item.path, item.why)
            _remove_quietly(item.path)
    _remove_empty_steps(root)
    others = [(s, d) for s, d in step_dirs(root) if s != committed and _markers(d)]
    kept = [s for s, _d in others if s in restorable][::-1][: keep - 1]
    for step, folder in others:
        if step in kept:
            continue
        if step not in restorable:
            log.warning(
                "local tier: deleting step %d ('%s'): this job cannot restore it (a rank's "
                "part has no copy left, or another world size saved it)",
                step,
                folder,
            )
        start = time.perf_counter()
        try:
            for marker in _markers(folder):
                marker.unlink(missing_ok=True)
                fsync_dir(marker.parent)
            fault_point("local-cleanup")
            _remove(folder)
            fsync_dir(root)
        except OSError as e:
            log.warning("local tier: could not delete step %d at '%s': %s", step, folder, e)
            continue
        log.info(
            "local tier: deleted step %d ('%s') in %.2fs",
            step,
            folder,
            time.perf_counter() - start,
        )


def _markers(folder: Path) -> list[Path]:
    return sorted(folder.glob("*/commit.rank*.json"))


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _remove_quietly(path: Path) -> None:
    """Delete a leftover; a failure is logged, not raised: it only costs space."""
    try:
        _remove(path)
    except OSError as e:
        log.warning("local tier: could not delete '%s': %s", path, e)


def _remove_empty_steps(root: Path) -> None:
    """Remove step folders that hold nothing any more (their leftovers were deleted)."""
    for _step, folder in step_dirs(root):
        try:
            folder.rmdir()  # only when empty
        except OSError:
            continue
