"""Checking a checkpoint's files against its `.manifest.json`.

`verify_checkpoint` compares one listing of the folder with the manifest: missing, resized and
unexpected files, manifest entries that escape the folder (reported, never opened) and, when
`deep`, the CRC32C of every byte. A checkpoint without a manifest (written by OLMo-core) or a bare
DCP folder is valid but unverifiable. `core/load.py` runs the check before a load, on rank 0.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import google_crc32c

from trainckpt.errors import CorruptCheckpointError
from trainckpt.format.folder import is_committed, require_folder, step_folders
from trainckpt.format.layout import (
    CLAIM_FILE,
    DCP_METADATA_FILE,
    MANIFEST_FILE,
    METADATA_FILE,
    dcp_dirname,
    is_safe_relpath,
)
from trainckpt.format.records import CheckpointManifest, read_manifest, read_metadata
from trainckpt.storage import Storage
from trainckpt.storage.checksums import FileEntry, crc32c_bytes

log = logging.getLogger(__name__)

Progress = Callable[[int], None]
"""Receives byte counts as files are checked (sizes when shallow, bytes read when deep)."""

_CHUNK = 8 * 1024 * 1024
_RECORDS = (METADATA_FILE, MANIFEST_FILE)
_LEFT_BY_SAVES = (CLAIM_FILE,)
"""Not part of a checkpoint, and harmless in one: a claim a crash after the commit left."""


@dataclass
class VerifyReport:
    """What `Checkpointer.verify` found. `ok` means no problem; `unverifiable` means there was
    no manifest to check the files against (OLMo-core checkpoints, bare DCP folders)."""

    path: str
    deep: bool = False
    problems: list[str] = field(default_factory=list)
    unverifiable: bool = False
    files_checked: int = 0
    bytes_checked: int = 0
    manifest: CheckpointManifest | None = field(default=None, repr=False)
    """The manifest the files were checked against, when there is a readable one."""

    @property
    def ok(self) -> bool:
        return not self.problems

    def __str__(self) -> str:
        if self.problems:
            return f"'{self.path}' has {len(self.problems)} problem(s):\n  " + "\n  ".join(
                self.problems
            )
        if self.unverifiable:
            return f"'{self.path}' is valid but unverifiable: it has no {MANIFEST_FILE}"
        how = "sizes and CRC32C" if self.deep else "sizes"
        return f"'{self.path}' is ok ({self.files_checked} files, {how} checked)"

    def raise_if_bad(self) -> None:
        """Raise `CorruptCheckpointError` naming every problem, if there is any."""
        if self.problems:
            raise CorruptCheckpointError(
                f"checkpoint {self}\nThe checkpoint is damaged: load an older one "
                "(Checkpointer.find_latest_good) or restore it from a copy"
            )


def verify_checkpoint(
    storage: Storage,
    path: str,
    *,
    deep: bool = False,
    progress: Progress | None = None,
    thread_count: int = 4,
) -> VerifyReport:
    """Check the checkpoint folder `path` against its manifest. Reads one listing and the two
    JSON records; with `deep`, every byte too. Raises `CheckpointNotFoundError` only when
    `path` is not a folder; everything wrong inside it is a problem in the report."""
    report = VerifyReport(path=path, deep=deep)
    manifest = report.manifest = _read_records(storage, path, report)
    if manifest is None:
        return report
    listing = _listing(storage, path, manifest)
    to_hash: list[tuple[str, FileEntry]] = []
    for rel, entry in manifest.files.items():
        where = storage.join(path, rel) if is_safe_relpath(rel) else rel
        if not is_safe_relpath(rel):
            report.problems.append(
                f"manifest entry '{rel}' escapes the checkpoint folder; it was not opened "
                "(the manifest is damaged or was tampered with)"
            )
        elif rel in _RECORDS:
            report.problems.append(
                f"manifest entry '{rel}' names a commit record, which a manifest never lists "
                "(the manifest is damaged or was tampered with)"
            )
        elif rel not in listing:
            report.problems.append(f"'{where}' is missing (the manifest lists it)")
        elif listing[rel] != entry.size:
            report.problems.append(
                f"'{where}' has {listing[rel]} bytes, the manifest says {entry.size} "
                "(truncated or overwritten)"
            )
        else:
            to_hash.append((rel, entry))
    for rel in sorted(set(listing) - set(manifest.files) - set(_RECORDS) - set(_LEFT_BY_SAVES)):
        report.problems.append(
            f"'{storage.join(path, rel)}' is not in the manifest (an unexpected file; "
            "remove it if it was added to the checkpoint after the save)"
        )
    report.files_checked = len(to_hash)
    report.bytes_checked = sum(e.size for _, e in to_hash)
    if deep:
        report.problems += check_crcs(storage, path, to_hash, progress, thread_count)
    elif progress is not None and report.bytes_checked:
        progress(report.bytes_checked)
    return report


def newest_good(storage: Storage, path: str, *, deep: bool = False) -> str | None:
    """The newest committed checkpoint under `path` that passes `verify_checkpoint` (sizes, or
    with `deep` every CRC32C), checked from the newest down; each one that fails is skipped
    with a warning naming it and why. None when there is none, or no folder at `path`.
    Called on: one process (`Checkpointer.find_latest_good` runs it on rank 0)."""
    try:
        folders = step_folders(storage, path)
    except FileNotFoundError:
        if storage.exists(path):
            raise
        return None
    for f in reversed(folders):
        if not is_committed(storage, f.path):
            continue
        report = verify_checkpoint(storage, f.path, deep=deep)
        if report.ok:
            return f.path
        log.warning(
            "skipping checkpoint '%s': it failed verification: %s",
            f.path,
            "; ".join(report.problems),
        )
    return None


def _read_records(storage: Storage, path: str, report: VerifyReport) -> CheckpointManifest | None:
    """The manifest, or None after noting why the files cannot be checked against one."""
    meta_at = storage.join(path, METADATA_FILE)
    try:
        read_metadata(storage, path)
    except CorruptCheckpointError as e:
        report.problems.append(str(e))
    except FileNotFoundError:
        if _is_bare_dcp(storage, path):
            report.unverifiable = True
        else:
            require_folder(storage, path)
            report.problems.append(
                f"'{meta_at}' is missing: '{path}' is not a committed checkpoint "
                "(an interrupted save leaves such a folder; the next save of that step clears it)"
            )
        return None
    try:
        return read_manifest(storage, path)
    except CorruptCheckpointError as e:
        report.problems.append(str(e))
        return None
    except FileNotFoundError:
        report.unverifiable = True
        sub = dcp_dirname(storage.name(path))
        dcp_md = storage.join(path, *([sub] if sub else []), DCP_METADATA_FILE)
        if not storage.exists(dcp_md):
            report.problems.append(f"'{dcp_md}' is missing: the checkpoint has no model state")
        return None


def _is_bare_dcp(storage: Storage, path: str) -> bool:
    return storage.exists(storage.join(path, DCP_METADATA_FILE))


def _listing(storage: Storage, path: str, manifest: CheckpointManifest) -> dict[str, int]:
    """Relative path -> size of the folder's files: one listing, or one size query per manifest
    entry where the back end cannot list (HTTP; unexpected files then go unnoticed)."""
    if storage.supports_listing:
        return storage.list_files(path)
    sizes: dict[str, int] = {}
    for rel in manifest.files:
        if is_safe_relpath(rel):
            try:
                sizes[rel] = storage.size(storage.join(path, rel))
            except FileNotFoundError:
                pass
    return sizes


def check_crcs(
    storage: Storage,
    path: str,
    files: list[tuple[str, FileEntry]],
    progress: Progress | None = None,
    thread_count: int = 4,
) -> list[str]:
    """Recompute the CRC32C of each file (relative to `path`); one problem per mismatch."""
    lock = threading.Lock()

    def report_bytes(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    def check(item: tuple[str, FileEntry]) -> str | None:
        rel, entry = item
        where = storage.join(path, rel)
        try:
            crc, size = _crc32c(storage, where, report_bytes)
        except FileNotFoundError:
            return f"'{where}' is missing (it disappeared while being checked)"
        if (crc, size) != (entry.crc32c, entry.size):
            return (
                f"'{where}' is corrupt: CRC32C {crc} over {size} bytes, the manifest says "
                f"{entry.crc32c} over {entry.size}"
            )
        return None

    if not files:
        return []
    with ThreadPoolExecutor(max(1, min(thread_count, len(files)))) as pool:
        return [p for p in pool.map(check, files) if p is not None]


def _crc32c(storage: Storage, where: str, progress: Progress) -> tuple[str, int]:
    crc = google_crc32c.Checksum()
    size = 0
    with storage.open_read(where) as f:
        while chunk := f.read(_CHUNK):
            crc.update(chunk)
            size += len(chunk)
            progress(len(chunk))
    return crc.digest().hex(), size


def check_loaded_file(
    manifest: CheckpointManifest | None, rel: str, data: bytes, where: str
) -> None:
    """Raise `CorruptCheckpointError` unless `data`, the file `rel` read whole for loading (trainer
    state, DCP's `.metadata`), has the size and CRC32C in `manifest`: a same-size file swapped
    in is caught without another read. Nothing to check without a manifest (or entry)."""
    entry = None if manifest is None else manifest.files.get(rel)
    if entry is None:
        return
    crc = crc32c_bytes(data)
    if (len(data), crc) != (entry.size, entry.crc32c):
        raise CorruptCheckpointError(
            f"'{where}' is not the file this checkpoint was saved with: CRC32C {crc} over "
            f"{len(data)} bytes, the manifest says {entry.crc32c} over {entry.size} (swapped, "
            "copied in from another checkpoint or damaged); load an older checkpoint "
            "(Checkpointer.find_latest_good) or restore this one from a copy"
        )
