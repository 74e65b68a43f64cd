"""The node-local tier's on-disk layout and records (docs/design.md §9; docs/local-tier.md).

```
<local_dir>/                    the same path on every node, each node's own disk
  .node-id                      random id of this disk (created once): which ranks share it
  step{S}/
    {attempt}/                  one save attempt of step S (id chosen by rank 0 of that save)
      rank{R}/                  the part of owner rank R: its own copy, or a replica
        module.pt               the rank's module state (torch.save, local shards only), or
        module.0.pt, module.1.pt, ...  the same bytes cut into pieces (a large part: its
                                pieces are written and flushed in parallel, `part_write.py`)
        train.pt                the rank's trainer state (torch.save of plain data)
        part.json               written last: owner, step, attempt, world size, and the size
                                and CRC32C of every data file (every piece)
      commit.rank{H}.json       phase-2 marker of holder rank H: the parts H holds here
      rank{R}.{file}.restore.tmp  while restoring, only where the filesystem has no O_TMPFILE:
                                a private copy's name for an instant (storage/private_file.py)
```

A part counts only where a commit marker of its own attempt, in the same attempt folder, lists
its owner: parts of two attempts at one step are never combined, and a crash before the markers
leaves nothing that counts. Everything here is what one disk holds; deciding what the job can
restore (the coverage vote) is `local/tier.py`'s.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainckpt.errors import CorruptCheckpointError
from trainckpt.format.layout import FORMAT_VERSION
from trainckpt.format.records import parse_record, read_record_bytes
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.local import LocalStorage

log = logging.getLogger(__name__)

NODE_ID_FILE = ".node-id"
MODULE_FILE = "module.pt"
TRAIN_FILE = "train.pt"
PART_FILE = "part.json"
PART_FILES = (MODULE_FILE, TRAIN_FILE)
"""The data files of a part, in the order a transfer sends them. Each is on disk under its own
name, or cut into pieces `piece_name(name, 0)`, `piece_name(name, 1)`, ... (its bytes are the
pieces' bytes in that order; `LocalPart.pieces`). Parts written before pieces existed (one file
each) are the one-piece case and read as they always were."""
MAX_PIECES = 64
"""Most pieces one data file may be cut into (a record listing more is refused)."""
MAX_RECORD_BYTES = 64 * 1024
"""Largest `part.json` or commit marker read (they hold a few hundred bytes)."""

_STEP_RE = re.compile(r"^step(\d{1,18})$")
_ATTEMPT_PATTERN = r"^[0-9a-f]{16}-[0-9a-f]{8}$"
_ATTEMPT_RE = re.compile(_ATTEMPT_PATTERN)
_PART_RE = re.compile(r"^rank(\d{1,9})$")
_COMMIT_RE = re.compile(r"^commit\.rank(\d{1,9})\.json$")


def piece_name(name: str, index: int) -> str:
    """The file name of piece `index` of data file `name` (`module.pt`, 1 -> `module.1.pt`)."""
    stem, _dot, suffix = name.rpartition(".")
    return f"{stem}.{index}.{suffix}"


def new_attempt_id() -> str:
    """A fresh save attempt id: nanoseconds since the epoch (so ids sort by time), then random."""
    return f"{time.time_ns():016x}-{secrets.token_hex(4)}"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step{step}"


def attempt_dir(root: Path, step: int, attempt: str) -> Path:
    return step_dir(root, step) / attempt


def part_dir(root: Path, step: int, attempt: str, owner: int) -> Path:
    return attempt_dir(root, step, attempt) / f"rank{owner}"


def commit_file(root: Path, step: int, attempt: str, holder: int) -> Path:
    return attempt_dir(root, step, attempt) / f"commit.rank{holder}.json"


class LocalPart(BaseModel):
    """`part.json`: what one owner rank's part of one save attempt holds."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1] = FORMAT_VERSION
    step: int = Field(ge=0)
    attempt: str = Field(pattern=_ATTEMPT_PATTERN)
    owner: int = Field(ge=0)
    world_size: int = Field(ge=1)
    files: dict[str, FileEntry]

    """Every file on disk holding the part's bytes (a data file of `PART_FILES`, or its pieces)
    with its size and CRC32C."""

    @field_validator("files")
    @classmethod
    def _exactly_the_part_files(cls, files: dict[str, FileEntry]) -> dict[str, FileEntry]:
        listed = 0
        for name in PART_FILES:
            count = len(_piece_names(name, files))
            if count == 0:
                raise ValueError(
                    f"must list '{name}' or its pieces '{piece_name(name, 0)}', "
                    f"'{piece_name(name, 1)}', ... (at most {MAX_PIECES}); lists {sorted(files)}"
                )
            listed += count
        if listed != len(files):
            raise ValueError(
                f"lists files that are no data file of a part or no piece of one in order: "
                f"{sorted(files)}"
            )
        return files

    def pieces(self, name: str) -> list[tuple[str, FileEntry]]:
        """The files holding data file `name` (one of `PART_FILES`), in order: `name` itself,
        or its pieces."""
        return [(f, self.files[f]) for f in _piece_names(name, self.files)]

    def stream(self) -> list[tuple[str, str, FileEntry]]:
        """(data file, file on disk, its entry) in the order a transfer sends the part's
        bytes: the data files in `PART_FILES` order, each piece by piece."""
        return [(name, f, e) for name in PART_FILES for f, e in self.pieces(name)]

    def file_size(self, name: str) -> int:
        """Bytes of data file `name`, all its pieces together."""
        return sum(e.size for _f, e in self.pieces(name))

    @property
    def size(self) -> int:
        return sum(e.size for e in self.files.values())


def _piece_names(name: str, files: dict[str, FileEntry]) -> list[str]:
    """The files of `files` that hold data file `name`: `[name]`, or its pieces `0 .. k-1`
    (the run of consecutive pieces from 0; nothing when both or neither are listed)."""
    whole = name in files
    pieces: list[str] = []
    while len(pieces) < MAX_PIECES and piece_name(name, len(pieces)) in files:
        pieces.append(piece_name(name, len(pieces)))
    if whole == bool(pieces):
        return []
    return [name] if whole else pieces


class LocalCommit(BaseModel):
    """`commit.rank{H}.json`: holder rank H's phase-2 marker; its parts of this attempt count."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: Literal[1] = FORMAT_VERSION
    step: int = Field(ge=0)
    attempt: str = Field(pattern=_ATTEMPT_PATTERN)
    world_size: int = Field(ge=1)
    holder: int = Field(ge=0)
    parts: list[int] = Field(max_length=1 << 20)


_COPY_IGNORED = "that copy is ignored (another copy, or an older step, is used)"

M = TypeVar("M", bound=BaseModel)


def read_local_record(path: Path, model: type[M]) -> M:
    """A `part.json` or commit marker, size-bounded and validated; `CorruptCheckpointError`
    naming the file when it is not one (`CheckpointNotFoundError` when it is missing)."""
    data = read_record_bytes(LocalStorage(), str(path), MAX_RECORD_BYTES)
    return parse_record(data, model, f"'{path}'", "local-tier record", _COPY_IGNORED)


def write_local_record(path: Path, record: BaseModel) -> None:
    """Write a record durably and atomically (temp file, fsync, rename, fsync the folder)."""
    LocalStorage().write_bytes(str(path), record.model_dump_json(indent=1).encode())


def read_node_id(root: Path) -> str:
    """The id of the disk under `root`, created (once, atomically) by the first rank to ask.

    Ranks that read the same id share a disk: a replica on such a rank would be no replica.
    Called on: every rank of the local tier, at start-up."""
    path = root / NODE_ID_FILE
    if not path.exists():
        tmp = root / f".node-id.{secrets.token_hex(4)}.tmp"
        tmp.write_text(secrets.token_hex(16))
        try:
            os.link(tmp, path)  # fails if another rank of this node was first: use its id
        except FileExistsError:
            pass
        finally:
            tmp.unlink(missing_ok=True)
    return path.read_text().strip()


@dataclass(frozen=True)
class Holding:
    """A committed part on this disk: counted in the coverage vote."""

    step: int
    attempt: str
    owner: int
    world_size: int
    size: int
    """Bytes of its data files on disk (the manifest's total when the sizes matched)."""


@dataclass(frozen=True)
class LocalLeftover:
    """Something of the local tier on this disk that counts for nothing (a crash left it)."""

    step: int
    path: Path
    why: str


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """The step folders under `root`, ascending by step (other entries are not ours)."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        m = _STEP_RE.match(name)
        if m and (root / name).is_dir() and not (root / name).is_symlink():
            out.append((int(m.group(1)), root / name))
    return sorted(out)


def _commits(folder: Path) -> dict[int, LocalCommit | None]:
    """The commit markers in an attempt folder by holder (None: unreadable)."""
    out: dict[int, LocalCommit | None] = {}
    for name in os.listdir(folder):
        m = _COMMIT_RE.match(name)
        if not m:
            continue
        try:
            out[int(m.group(1))] = read_local_record(folder / name, LocalCommit)
        except (CorruptCheckpointError, FileNotFoundError) as e:
            log.warning("local tier: ignoring commit marker '%s': %s", folder / name, e)
            out[int(m.group(1))] = None
    return out


def scan(root: Path) -> tuple[list[Holding], list[LocalLeftover]]:
    """What the disk under `root` holds: committed parts (a marker of their attempt lists them
    and their records and file sizes agree), and leftovers that count for nothing (parts no
    marker lists, attempts without a marker, temp files). Damaged committed parts are logged
    and neither counted nor listed as leftovers (another copy may still be read).

    Called on: any rank; reads only this disk."""
    holdings: list[Holding] = []
    leftovers: list[LocalLeftover] = []
    for step, sdir in step_dirs(root):
        for name in sorted(os.listdir(sdir)):
            adir = sdir / name
            if not _ATTEMPT_RE.match(name) or not adir.is_dir() or adir.is_symlink():
                if name.endswith(".tmp"):
                    leftovers.append(LocalLeftover(step, adir, "temporary file of a crashed write"))
                continue
            commits = _commits(adir)
            listed = {
                p
                for c in commits.values()
                if c is not None and c.step == step and c.attempt == name
                for p in c.parts
            }
            if not commits:
                leftovers.append(LocalLeftover(step, adir, "a save attempt that never committed"))
                continue
            for entry in sorted(os.listdir(adir)):
                m = _PART_RE.match(entry)
                if entry.endswith(".tmp"):
                    leftovers.append(
                        LocalLeftover(step, adir / entry, "temporary file of a crashed write")
                    )
                elif m and int(m.group(1)) not in listed:
                    leftovers.append(
                        LocalLeftover(step, adir / entry, "a part no commit marker lists")
                    )
                elif m:
                    held = _holding(adir / entry, step, name, int(m.group(1)))
                    if held is not None:
                        holdings.append(held)
    return holdings, leftovers


def _holding(folder: Path, step: int, attempt: str, owner: int) -> Holding | None:
    """The part in `folder` if its record matches where it is and its files have their sizes."""
    try:
        part = read_local_record(folder / PART_FILE, LocalPart)
    except (CorruptCheckpointError, FileNotFoundError) as e:
        log.warning("local tier: part '%s' is unusable (%s); another copy is needed", folder, e)
        return None
    if (part.step, part.attempt, part.owner) != (step, attempt, owner):
        log.warning(
            "local tier: '%s' names step %d, attempt %s, rank %d, not where it lies; ignored",
            folder / PART_FILE,
            part.step,
            part.attempt,
            part.owner,
        )
        return None
    for name, entry in part.files.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            size = -1
        if size != entry.size:
            log.warning(
                "local tier: '%s' has %d bytes, its part.json says %d; that copy is not used",
                folder / name,
                size,
                entry.size,
            )
            return None
    return Holding(step, attempt, owner, part.world_size, part.size)
