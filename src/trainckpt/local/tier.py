"""The node-local tier (docs/design.md §9): each rank saves its own part to its node's disk,
replicas go to peers on other nodes, a two-phase commit with no shared place decides what
counts, and a coverage vote finds the newest step the live ranks can assemble.

Save (all ranks, the checkpointer's CPU group; the layout is `local/layout.py`):
1. Rank 0 picks an attempt id. Each rank writes its part (module state, trainer state, then
   `part.json` with sizes and CRC32C), each file and folder fsynced.
2. Each part is sent in pipelined chunks (`local/transfer.py`) to `replication_factor - 1`
   holders on other disks, `replication_jump` ranks apart; each holder writes it durably (past
   the page cache where it can) and checks every CRC32C against the owner's `part.json`. The
   ranks agree that every part and replica is durable and intact (phase 1).
3. Only then each rank writes its commit marker naming step, attempt and the parts it holds
   (phase 2), and the ranks agree again: the save is committed.
4. The ranks count the steps they can restore (the coverage vote); one rank per disk then
   deletes the steps beyond the `keep` newest restorable ones, markers first. A step that lost
   a part never displaces a restorable one.

Restore: every rank reports what its disk holds; the newest (step, attempt) whose every owner
rank's part is held by some live rank wins, the same answer everywhere. Each rank copies its
own part from its disk, or else receives it from a holder on another disk, into a private
file on its own disk (`storage/private_file.py`: no name, no other process can open it),
computing the CRC32C of exactly the bytes it writes there; only a copy that matches the
record is loaded, and what is loaded is that copy (check what you copy: a part changed on
disk meanwhile changes nothing loaded). The module file is memory-mapped from the copy, so no
rank holds a whole part in memory besides the module it loads into. A bad copy falls back to
the next holder, and a step that cannot be assembled to an older one (`restore_latest`).
Parts are found by owner rank, never by node: ranks that restart on other nodes still
restore. Nothing read is ever unpickled but by `load_torch_plain`.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import google_crc32c
import torch

from trainckpt.core import dist
from trainckpt.core.staging import dtensor_type
from trainckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from trainckpt.faults import fault_point
from trainckpt.format.safe_unpickle import load_torch_plain
from trainckpt.format.trainer_state import deserialize_trainer_state
from trainckpt.local.layout import (
    MODULE_FILE,
    PART_FILE,
    PART_FILES,
    TRAIN_FILE,
    Holding,
    LocalCommit,
    LocalPart,
    attempt_dir,
    commit_file,
    new_attempt_id,
    part_dir,
    read_local_record,
    read_node_id,
    scan,
    step_dirs,
    write_local_record,
)
from trainckpt.local.transfer import PhaseClock, Sink, Transfer, exchange
from trainckpt.storage.checksummed_file import ChecksummedWriter
from trainckpt.storage.checksums import FileEntry
from trainckpt.storage.direct_file import DirectWriter, direct_file
from trainckpt.storage.local import fsync_dir, writing
from trainckpt.storage.private_file import PrivateFile

log = logging.getLogger(__name__)


@dataclass
class LocalTier:
    """The local tier of one job under `root` (the same path on every node). Build it on every
    rank with the checkpointer's CPU process group; every method is called on all ranks."""

    root: Path
    group: dist.ProcessGroup | None = None
    replication_factor: int = 2
    replication_jump: int | None = None
    """Ranks between a part and its replica; None: ranks per node (`LOCAL_WORLD_SIZE`)."""
    keep: int = 2
    _warned: bool = field(default=False, init=False)
    _disks: list[str] = field(default_factory=list, init=False)
    """The disk id of each rank (ranks with the same id share a disk)."""

    # -- start-up -------------------------------------------------------------------------------
    def open(self) -> None:
        """Learn which ranks share a disk and clean crashed leftovers (once per job).

        Called on: all ranks (the first save or restore calls it)."""
        if self._disks:
            return
        error: Exception | None = None
        disk = ""
        try:
            with writing(self.root):
                self.root.mkdir(parents=True, exist_ok=True)
                disk = read_node_id(self.root)
        except Exception as e:
            error = e
        dist.agree(error, f"opening the local checkpoint folder '{self.root}'", self.group)
        self._disks = dist.all_gather_object(disk, self.group)
        if self._is_disk_leader():
            self._clean_leftovers()
        dist.barrier(self.group)

    def _is_disk_leader(self) -> bool:
        rank = dist.get_rank(self.group)
        return self._disks.index(self._disks[rank]) == rank

    def _clean_leftovers(self) -> None:
        """Delete what crashed saves left on this disk (it counts for nothing)."""
        for item in scan(self.root)[1]:
            log.info("local tier: deleting '%s' (%s)", item.path, item.why)
            _remove_quietly(item.path)
        _remove_empty_steps(self.root)

    # -- saving ---------------------------------------------------------------------------------
    def holders(self, owner: int) -> list[int]:
        """The ranks that keep a replica of `owner`'s part: `replication_jump` apart, each on a
        disk no other copy is on."""
        world = dist.get_world_size(self.group)
        jump = self.replication_jump or int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        disks, out = {self._disks[owner]}, []
        for k in range(1, self.replication_factor):
            holder = (owner + k * jump) % world
            if self._disks[holder] not in disks:
                disks.add(self._disks[holder])
                out.append(holder)
        return out

    def save(self, step: int, state: dict[str, Any], trainer_bytes: bytes) -> str:
        """Save and commit this rank's part of `step` (a staged state dict and serialized
        trainer state); return the attempt id. Raises on every rank if any rank failed; a
        failed save leaves nothing that counts. The log line names the time of every phase
        (`PHASES`). Called on: all ranks (background thread)."""
        start = time.perf_counter()
        clock = PhaseClock()
        self.open()
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        with clock("agree"):
            attempt = dist.broadcast_object(new_attempt_id(), self.group)
        what = f"local checkpoint step {step} (attempt {attempt}) under '{self.root}'"
        part: LocalPart | None = None
        error: Exception | None = None
        try:
            part = self._write_own(step, attempt, state, trainer_bytes, world, clock)
        except Exception as e:
            error = e
        with clock("agree"):
            dist.agree(error, f"writing {what}", self.group)
            parts: list[LocalPart] = dist.all_gather_object(part, self.group)  # type: ignore[arg-type]

        transfers = [
            Transfer(src=owner, dst=h, owner=owner, size=parts[owner].size)
            for owner in range(world)
            for h in self.holders(owner)
        ]
        self._warn_thin_replication(transfers, world)
        replication = time.perf_counter()
        failures = exchange(
            transfers,
            self.group,
            open_source=lambda t: _PartReader(part_dir(self.root, step, attempt, t.owner), part),
            open_sink=lambda t: _PartWriter(
                self.root, part_dir(self.root, step, attempt, t.owner), parts[t.owner]
            ),
            clock=clock,
        )
        with clock("agree"):
            dist.agree(_first_failure(failures, transfers, what), f"replicating {what}", self.group)
        replication = time.perf_counter() - replication

        fault_point("local-between-phases")
        held = sorted({rank, *(t.owner for t in transfers if t.dst == rank)})
        error = None
        with clock("marker"):
            try:
                marker = LocalCommit(
                    step=step, attempt=attempt, world_size=world, holder=rank, parts=held
                )
                write_local_record(commit_file(self.root, step, attempt, rank), marker)
            except Exception as e:
                error = e
        with clock("agree"):
            dist.agree(error, f"committing {what}", self.group)
        committed = time.perf_counter() - start
        phases = {name: clock.seconds.get(name, 0.0) for name in PHASES}
        log.info(
            "committed local checkpoint step %d (attempt %s, %d bytes own part, %d replicas "
            "held) in %.2fs: %s",
            step,
            attempt,
            parts[rank].size,
            len(held) - 1,
            committed,
            ", ".join(f"{k} {v:.3f}s" for k, v in phases.items()),
            extra={  # for tools (scripts/bench_local.py)
                "local_save_seconds": {
                    "committed": committed,
                    "replication": replication,
                    **phases,
                }
            },
        )
        restorable = {s for s, _a in self.covered()}
        if self._is_disk_leader():
            self._retain(step, restorable)
        return attempt

    def _write_own(
        self,
        step: int,
        attempt: str,
        state: dict[str, Any],
        trainer_bytes: bytes,
        world: int,
        clock: PhaseClock,
    ) -> LocalPart:
        rank = dist.get_rank(self.group)
        folder = part_dir(self.root, step, attempt, rank)
        with writing(folder):
            folder.mkdir(parents=True)
        files: dict[str, FileEntry] = {}
        with _timed_file(folder / MODULE_FILE, clock) as w:
            _torch_save_without_zip_crc(_local_view(state), w)
        files[MODULE_FILE] = w.entry()
        fault_point("local-writing")
        with _timed_file(folder / TRAIN_FILE, clock) as w:
            w.write(trainer_bytes)
        files[TRAIN_FILE] = w.entry()
        part = LocalPart(step=step, attempt=attempt, owner=rank, world_size=world, files=files)
        with clock("fsync"):
            write_local_record(folder / PART_FILE, part)
            _fsync_up_to(folder, self.root)
        return part

    def _warn_thin_replication(self, transfers: list[Transfer], world: int) -> None:
        """Warn once (rank 0) when some part has no replica on another disk."""
        if dist.get_rank(self.group) != 0 or self.replication_factor < 2 or self._warned:
            return
        self._warned = True
        thin = [o for o in range(world) if sum(t.owner == o for t in transfers) < 1]
        if thin:
            log.warning(
                "local tier: the parts of ranks %s have no replica on another disk "
                "(replication_factor=%d, replication_jump=%s, %d disks): losing their node "
                "loses the step; set replication_jump to the number of ranks per node",
                thin,
                self.replication_factor,
                self.replication_jump,
                len(set(self._disks)),
            )

    def _retain(self, committed: int, restorable: set[int]) -> None:
        """Keep the step just committed and the `keep - 1` newest other steps that the job can
        restore (`restorable`: every rank's part has a copy the coverage vote counts, the same
        test a restore uses); delete the rest, commit markers first (a crash midway leaves
        parts that no longer count, never a step that counts but is incomplete). A step that
        lost a part is deleted and never displaces an older restorable one. Called on: one
        rank per disk, after a save committed on every rank."""
        for item in scan(self.root)[1]:  # what failed saves of older steps left
            if item.step < committed:
                log.info("local tier: deleting '%s' (%s)", item.path, item.why)
                _remove_quietly(item.path)
        _remove_empty_steps(self.root)
        others = [(s, d) for s, d in step_dirs(self.root) if s != committed and _markers(d)]
        kept = [s for s, _d in others if s in restorable][::-1][: self.keep - 1]
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
                fsync_dir(self.root)
            except OSError as e:
                log.warning("local tier: could not delete step %d at '%s': %s", step, folder, e)
                continue
            log.info(
                "local tier: deleted step %d ('%s') in %.2fs",
                step,
                folder,
                time.perf_counter() - start,
            )

    # -- finding --------------------------------------------------------------------------------
    def _inventory(self) -> list[list[Holding]]:
        """What every rank's disk holds, committed parts only, in rank order."""
        self.open()
        holdings: list[Holding] = []
        error: Exception | None = None
        try:
            holdings, _ = scan(self.root)
        except Exception as e:
            error = e
        dist.agree(error, f"listing the local checkpoints under '{self.root}'", self.group)
        return dist.all_gather_object(holdings, self.group)

    def covered(self) -> list[tuple[int, str]]:
        """The (step, attempt) pairs the live ranks can assemble, newest first: every owner
        rank's part of that attempt is held by some rank. The same list on every rank.
        Called on: all ranks."""
        world = dist.get_world_size(self.group)
        owners: dict[tuple[int, str], set[int]] = {}
        sizes: dict[tuple[int, str], set[int]] = {}
        for held in self._inventory():
            for h in held:
                owners.setdefault((h.step, h.attempt), set()).add(h.owner)
                sizes.setdefault((h.step, h.attempt), set()).add(h.world_size)
        good = [k for k, o in owners.items() if sizes[k] == {world} and o == set(range(world))]
        other = sorted({w for k, ws in sizes.items() for w in ws if w != world})
        if other and dist.get_rank(self.group) == 0:
            log.warning(
                "local tier: '%s' holds checkpoints saved by %s ranks; this job has %d ranks, "
                "and the local tier restores only to the world size that saved it: load from "
                "the save folder (persistent tier) instead",
                self.root,
                " or ".join(map(str, other)),
                world,
            )
        return sorted(good, reverse=True)

    def latest(self) -> int | None:
        """The newest step the live ranks can assemble, or None. Called on: all ranks."""
        covered = self.covered()
        return covered[0][0] if covered else None

    # -- restoring ------------------------------------------------------------------------------
    def restore(self, step: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """This rank's module state and trainer state of `step`, from its own disk or a holder.

        Raises `CheckpointNotFoundError` on every rank when the live ranks cannot assemble the
        step, `CorruptCheckpointError` on every rank when some part has no intact copy left.
        Called on: all ranks."""
        start = time.perf_counter()
        rank = dist.get_rank(self.group)
        attempts = [a for s, a in self.covered() if s == step]
        if not attempts:
            raise CheckpointNotFoundError(
                f"no local checkpoint of step {step} under '{self.root}' that the live ranks "
                "can assemble (not saved, not committed on every rank, or copies lost); use "
                "latest_local() to find one, or load from the save folder"
            )
        attempt = attempts[0]
        own = part_dir(self.root, step, attempt, rank)
        error: Exception | None = None
        state: dict[str, Any] = {}
        trainer: dict[str, Any] = {}
        with ExitStack() as files:  # the private copies; a mapping of them outlives this
            got: _PrivateCopy | None = None
            try:
                got = _copy_own(own, files)
            except FileNotFoundError:
                log.info("local tier: rank %d's part of step %d is not on this disk", rank, step)
            except Exception as e:  # any failure of this rank's read: the others go on below
                log.warning("local tier: own copy of rank %d's part is unusable: %s", rank, e)
            copy = self._receive_missing(step, attempt, got, files)
            fault_point("local-restore-checked")
            try:
                state, trainer = _load_part(copy)
            except Exception as e:
                error = e
        _agree_corrupt(error, f"reading local checkpoint step {step}", self.group)
        log.info(
            "restored rank %d's part of local checkpoint step %d (attempt %s) in %.2fs",
            rank,
            step,
            attempt,
            time.perf_counter() - start,
        )
        return state, trainer

    def restore_latest(self) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """The newest step that restores (falling back past steps with no intact copy of some
        part): (step, module state, trainer state), or None. Called on: all ranks."""
        for step in sorted({s for s, _a in self.covered()}, reverse=True):
            try:
                state, trainer = self.restore(step)
            except CorruptCheckpointError as e:
                log.warning(
                    "local tier: step %d cannot be restored, trying an older one: %s", step, e
                )
                continue
            return step, state, trainer
        return None

    def _receive_missing(
        self, step: int, attempt: str, got: _PrivateCopy | None, files: ExitStack
    ) -> _PrivateCopy:
        """The checked private copy of this rank's part to load: `got`, made from the own copy,
        or else one received from a holder on another disk (in chunks, every byte CRC32C-checked
        against the holder's record as it is written; memory is the transfer's chunk buffers,
        not the part). One holder per round until every rank's part is intact or some part has
        no holder left. The copies are closed with `files`. Called on: all ranks."""
        rank = dist.get_rank(self.group)
        records = self._part_records(step, attempt)
        tried: dict[int, set[int]] = {}
        sinks: dict[int, _PrivateCopy] = {}  # this round's copy by holder it comes from
        while True:
            need = dist.all_gather_object(got is None, self.group)
            needy = [r for r, n in enumerate(need) if n]
            if not needy:
                assert got is not None
                return got
            transfers, lost = [], []
            for owner in needy:
                seen = tried.setdefault(owner, set())
                options = [
                    h
                    for h, _part in records.get(owner, [])
                    if h not in seen and self._disks[h] != self._disks[owner]
                ]
                if not options:
                    lost.append(owner)
                    continue
                seen.add(options[0])
                size = next(p.size for h, p in records[owner] if h == options[0])
                transfers.append(Transfer(src=options[0], dst=owner, owner=owner, size=size))
            if lost:
                raise CorruptCheckpointError(
                    f"local checkpoint step {step} (attempt {attempt}) under '{self.root}': no "
                    f"intact copy left of the parts of ranks {lost} (see the warnings above); "
                    "an older step or the save folder must be used"
                )
            sinks.clear()

            def open_sink(t: Transfer) -> Sink:
                expected = next(p for h, p in records[t.owner] if h == t.src)
                folder = attempt_dir(self.root, step, attempt)  # gone with a wiped disk
                with writing(folder):
                    folder.mkdir(parents=True, exist_ok=True)
                source = part_dir(self.root, step, attempt, t.owner)
                sink = _PrivateCopy(folder, expected, f"rank {t.src}'s '{source}'")
                sinks[t.src] = files.enter_context(sink)
                return sink

            failures = exchange(
                transfers,
                self.group,
                open_source=lambda t: _PartReader(
                    part_dir(self.root, step, attempt, t.owner),
                    next(p for h, p in records[t.owner] if h == t.src),
                ),
                open_sink=open_sink,
            )
            for i, e in failures.items():
                log.warning(
                    "local tier: copying rank %d's part from rank %d failed: %s",
                    transfers[i].owner,
                    transfers[i].src,
                    e,
                )
            for i, t in enumerate(transfers):
                if t.dst == rank:
                    if i in failures:
                        if t.src in sinks:
                            sinks[t.src].drop()
                    else:
                        got = sinks[t.src]
                        log.info("local tier: received rank %d's part from rank %d", rank, t.src)

    def _part_records(self, step: int, attempt: str) -> dict[int, list[tuple[int, LocalPart]]]:
        """Each owner's holders of `step`/`attempt` with the `part.json` each holds, in rank
        order, one holder per disk. Called on: all ranks."""
        mine: list[LocalPart] = []
        for h in scan(self.root)[0]:
            if (h.step, h.attempt) == (step, attempt):
                try:
                    folder = part_dir(self.root, step, attempt, h.owner)
                    mine.append(read_local_record(folder / PART_FILE, LocalPart))
                except (CheckpointError, OSError) as e:
                    log.warning("local tier: %s", e)
        out: dict[int, list[tuple[int, LocalPart]]] = {}
        disks_seen: dict[int, set[str]] = {}
        for holder, parts in enumerate(dist.all_gather_object(mine, self.group)):
            for p in parts:
                if self._disks[holder] not in disks_seen.setdefault(p.owner, set()):
                    disks_seen[p.owner].add(self._disks[holder])
                    out.setdefault(p.owner, []).append((holder, p))
        return out


PHASES = (
    "serialize",
    "crc",
    "write",
    "fsync",
    "agree",
    "send read",
    "send wait",
    "receive wait",
    "receive write",
    "receive close",
    "marker",
)
"""The phases of a local save, as its log line and `local_save_seconds` name them: own part
(`serialize`: torch.save's own work; `crc`; `write`: into the page cache; `fsync`: the files,
`part.json` and folders), `agree` (the collectives of the two phases), replication (see
`exchange`), and the commit `marker`. Retention runs after the commit and the log line (its
own log lines time it)."""


_WRITE_BUFFER = 1 << 20
"""Buffer of the own part's files (torch.save's small header writes; large ones pass)."""


class _TimedWriter(ChecksummedWriter):
    """A `ChecksummedWriter` that books its time: `crc` (its own work) and `write` (the
    file's, through `_TimedFile`); `serialize` is what the caller spends between writes."""

    def __init__(self, f: _TimedFile, clock: PhaseClock) -> None:
        super().__init__(f)
        self._clock = clock
        self._timed_file = f
        self.crc_seconds = 0.0

    def write(self, data: Any) -> int:
        start, written = time.perf_counter(), self._timed_file.seconds
        n = super().write(data)
        crc = time.perf_counter() - start - (self._timed_file.seconds - written)
        self.crc_seconds += crc
        self._clock.add("crc", crc)
        return n


class _TimedFile:
    """A file whose writes are timed (`seconds`, and the clock's `write`)."""

    def __init__(self, f: Any, clock: PhaseClock) -> None:
        self._f, self._clock, self.seconds = f, clock, 0.0

    def write(self, data: Any) -> int:
        start = time.perf_counter()
        n: int = self._f.write(data)
        spent = time.perf_counter() - start
        self.seconds += spent
        self._clock.add("write", spent)
        return n

    def flush(self) -> None:
        with self._clock("write"):
            self._f.flush()


@contextmanager
def _timed_file(path: Path, clock: PhaseClock) -> Iterator[ChecksummedWriter]:
    """`checksummed_file` with its time booked into `clock` (`serialize`, `crc`, `write`,
    `fsync`)."""
    start = time.perf_counter()
    with writing(path), open(path, "xb", buffering=_WRITE_BUFFER) as f:
        timed = _TimedFile(f, clock)
        w = _TimedWriter(timed, clock)
        yield w
        timed.flush()
        booked = time.perf_counter() - start
        with clock("fsync"):
            os.fsync(f.fileno())
    clock.add("serialize", booked - timed.seconds - w.crc_seconds)


class _PartReader:
    """The data files of a part as one stream, in `PART_FILES` order, each exactly the size
    its record says (a shorter file is an error; the reader never reads past a size)."""

    def __init__(self, folder: Path, part: LocalPart | None) -> None:
        if part is None:
            raise CheckpointNotFoundError(f"no part record for '{folder}'")
        self._plan = [(folder / name, part.files[name].size) for name in PART_FILES]
        self._stack = ExitStack()
        self._file: Any = None
        self._left = 0

    def readinto(self, buf: memoryview) -> int:
        """Fill `buf` from the files, straight from the kernel (no copy in between)."""
        done = 0
        while done < len(buf):
            if self._left == 0:
                if self._file is not None:
                    self._file.close()
                    self._file = None
                if not self._plan:
                    break
                path, self._left = self._plan.pop(0)
                self._file = self._stack.enter_context(open(path, "rb", buffering=0))
                continue
            got = self._file.readinto(buf[done : done + min(len(buf) - done, self._left)])
            if not got:
                raise CorruptCheckpointError(f"'{self._file.name}' is shorter than its record")
            done += got
            self._left -= got
        return done

    def close(self) -> None:
        self._stack.close()


class _Splitter:
    """Cuts the incoming stream of a part into its files, by the sizes in its record."""

    def __init__(self, part: LocalPart) -> None:
        self.part = part
        self._plan = [(name, part.files[name].size) for name in PART_FILES]
        self._index = 0
        self._left = part.files[PART_FILES[0]].size

    @property
    def finished(self) -> bool:
        return self._index == len(self._plan)

    def pieces(self, data: memoryview) -> list[tuple[str, memoryview, bool]]:
        """(file name, bytes of it, whether that file is complete after them)."""
        out = []
        pos = 0
        while self._index < len(self._plan):
            name = self._plan[self._index][0]
            take = min(self._left, len(data) - pos)
            self._left -= take
            done = self._left == 0
            out.append((name, data[pos : pos + take], done))
            pos += take
            if not done:
                break
            self._index += 1
            if self._index < len(self._plan):
                self._left = self._plan[self._index][1]
        if pos != len(data):
            raise CorruptCheckpointError("received more bytes than the part's record lists")
        return out


class _PartWriter:
    """A replica received from a holder: its files written past the page cache where the disk
    allows (`direct_file`) and fsynced, each file's CRC32C computed from the bytes as they
    arrive and checked against the owner's record at the end, then the record written last and
    the folders fsynced."""

    def __init__(self, root: Path, folder: Path, part: LocalPart) -> None:
        self._root, self._folder, self._split = root, folder, _Splitter(part)
        with writing(folder):
            folder.mkdir(parents=True)
        self._stack = ExitStack()
        self._writer: DirectWriter | None = None
        self._entries: dict[str, FileEntry] = {}

    def write(self, data: memoryview) -> None:
        for name, piece, done in self._split.pieces(data):
            writer = self._writer
            if writer is None:
                writer = self._writer = self._stack.enter_context(direct_file(self._folder / name))
            writer.write(piece)
            if done:
                self._stack.close()  # the tail written and fsynced
                self._entries[name] = writer.entry()
                self._writer = None

    def close(self) -> None:
        if not self._split.finished:
            self.write(memoryview(b""))  # creates the empty files left, if that is all
        self._stack.close()
        part = self._split.part
        for name in PART_FILES:
            _check_entry(self._entries.get(name), part.files[name], str(self._folder / name))
        write_local_record(self._folder / PART_FILE, part)
        _fsync_up_to(self._folder, self._root)


class _PrivateCopy:
    """A part's files copied into private files (`storage/private_file.py`) in the attempt
    folder, each file's CRC32C computed from exactly the bytes written into it and checked
    against the part's record when the copy is closed. Loading from it loads what was checked,
    whatever happens to the part's own files meanwhile (check what you copy). A sink of
    `exchange` (a copy received from a holder), or filled from the own copy (`_copy_own`)."""

    def __init__(self, folder: Path, part: LocalPart, source: str) -> None:
        self.part, self._split = part, _Splitter(part)
        self.source = source  # the part copied, for messages
        owner = f"rank{part.owner}"
        self.files = {
            name: PrivateFile(folder, f"{owner}.{name}.restore.tmp") for name in PART_FILES
        }
        self.checked = False

    def write(self, data: memoryview) -> None:
        for name, piece, _done in self._split.pieces(data):
            self.files[name].write(piece)

    def close(self) -> None:
        """Check every file against the record (`CorruptCheckpointError` naming it)."""
        if self.checked:
            return
        for name in PART_FILES:
            where = f"'{name}' of {self.source}, as copied for the restore"
            _check_entry(self.files[name].entry(), self.part.files[name], where)
        self.checked = True

    def drop(self) -> None:
        """Free the files (a failed copy)."""
        for f in self.files.values():
            f.close()

    def __enter__(self) -> _PrivateCopy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.drop()


_COPY_CHUNK = 8 << 20
"""Bytes per read when copying the own part into its private copy."""


def _copy_own(folder: Path, files: ExitStack) -> _PrivateCopy:
    """A checked private copy of the part in `folder` (read in chunks of `_COPY_CHUNK`, each
    CRC'd as it is written to the copy); `FileNotFoundError` when there is no part there, a
    `CorruptCheckpointError` naming the file when a byte differs from the record. The copy is
    closed with `files`."""
    if not (folder / PART_FILE).exists():
        raise FileNotFoundError(folder / PART_FILE)
    part = read_local_record(folder / PART_FILE, LocalPart)
    copy = files.enter_context(_PrivateCopy(folder.parent, part, f"'{folder}'"))
    source = _PartReader(folder, part)
    buf = memoryview(bytearray(min(_COPY_CHUNK, max(part.size, 1))))
    try:
        while got := source.readinto(buf):
            copy.write(buf[:got])
        copy.close()
    except BaseException:
        copy.drop()  # its disk space is free again at once
        raise
    finally:
        source.close()
    return copy


def _load_part(copy: _PrivateCopy) -> tuple[dict[str, Any], dict[str, Any]]:
    """The module state and trainer state of a checked private copy: the module file
    memory-mapped (its tensors are views of the copy's pages, so a part of any size needs no
    memory of its size until it is copied into the module), the small trainer file read and
    checked once more as the bytes that are unpickled."""
    where = f"'{MODULE_FILE}' of {copy.source}, as copied and checked"
    state = load_torch_plain(Path(copy.files[MODULE_FILE].path), where)
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where} holds no state dict")
    data = copy.files[TRAIN_FILE].read_all()
    train_where = f"'{TRAIN_FILE}' of {copy.source}, as copied and checked"
    _check(data, copy.part.files[TRAIN_FILE], train_where)
    return state, deserialize_trainer_state(data, train_where)


def _check(data: bytes, entry: FileEntry, where: str) -> None:
    got = FileEntry(size=len(data), crc32c=f"{google_crc32c.value(data):08x}")
    _check_entry(got, entry, where)


def _check_entry(got: FileEntry | None, want: FileEntry, where: str) -> None:
    if got is None or got != want:
        raise CorruptCheckpointError(
            f"'{where}' does not match its part record (got {got}, expected size "
            f"{want.size}, CRC32C {want.crc32c}): that copy is damaged and is not used"
        )


def _first_failure(
    failures: dict[int, BaseException], transfers: list[Transfer], what: str
) -> Exception | None:
    if not failures:
        return None
    i, e = next(iter(failures.items()))
    t = transfers[i]
    if isinstance(e, CheckpointError):
        return e
    error = CorruptCheckpointError(
        f"copying rank {t.owner}'s part of {what} to rank {t.dst} failed "
        f"({type(e).__name__}: {e}); nothing was committed"
    )
    error.__cause__ = e
    return error


def _agree_corrupt(error: BaseException | None, what: str, group: Any) -> None:
    """Raise the same `CorruptCheckpointError` on every rank when any rank failed `what`, so
    every rank takes the same fall-back. Called on: all ranks."""
    msg = None if error is None else f"{type(error).__name__}: {error}"
    outcomes = dist.all_gather_object(msg, group)
    failed = [f"rank {r}: {m}" for r, m in enumerate(outcomes) if m is not None]
    if failed:
        raise CorruptCheckpointError(f"{what} failed: {'; '.join(failed)}") from error


def _torch_save_without_zip_crc(obj: Any, f: ChecksummedWriter) -> None:
    """`torch.save(obj, f)` without the CRC32 torch's zip writer computes of every record (a
    second pass over every byte, about a third of the write's time). `torch.load` does not
    need it, and the part's CRC32C covers every byte of the file. This goes through torch's
    private `_save` (what `torch.save` runs with `set_crc32_options(False)`, which is
    process-wide and would race with the training thread's own `torch.save` calls); a torch
    without it gets a plain `torch.save`."""
    serialization: Any = torch.serialization
    try:
        writer = torch._C.PyTorchFileWriter(
            cast(Any, f), False, serialization._get_storage_alignment()
        )
        save = serialization._save
    except (AttributeError, TypeError):
        torch.save(obj, f)  # type: ignore[arg-type]  # a write-only file
        return
    save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    writer.write_end_of_file()


def _local_view(state: Any) -> Any:
    """`state` with every DTensor replaced by this rank's local shard (the local tier restores
    only to the same world size and layout, so the local shard is all a rank needs)."""
    DTensor = dtensor_type()
    if DTensor is not None and isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {k: _local_view(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_local_view(v) for v in state]
    return state


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


def _fsync_up_to(folder: Path, root: Path) -> None:
    """fsync `folder` and each parent up to and including `root` (new folders are entries of
    their parents: without this a power cut may lose them)."""
    current = folder
    while True:
        fsync_dir(current)
        if current == root or current == current.parent:
            return
        current = current.parent


def load_into(train_module: Any, saved: dict[str, Any], where: str) -> None:
    """Apply a restored part to `train_module`, as a DCP load would: the module's own state
    dict to load (`state_dict_to_load`, its shardings) is filled in place, key by key, from
    the saved local tensors (a DTensor's local shard from the saved shard), then applied with
    `load_state_dict`. A key the part lacks, or a tensor of another shape or dtype, is a
    `CorruptCheckpointError` naming it. Called on: each rank, for its own part."""
    keys: dict[str, None] = {}
    for k, v in saved.items():
        keys.update({f"{k}.{sub}": None for sub in v} if isinstance(v, dict) else {k: None})
    target = train_module.state_dict_to_load(SimpleNamespace(state_dict_metadata=keys))
    with torch.no_grad():
        _fill(target, saved, "", where)
    train_module.load_state_dict(target)


def _fill(target: dict[str, Any], saved: Any, path: str, where: str) -> None:
    if not isinstance(saved, dict):
        raise CorruptCheckpointError(f"{where}: '{path}' is no dict in the saved part")
    DTensor = dtensor_type()
    for k, t in target.items():
        key = f"{path}{k}"
        if k not in saved:
            raise CorruptCheckpointError(
                f"{where}: the saved part has no '{key}', which the module expects; was it "
                "saved by another model or sharding? Load from the save folder instead"
            )
        s = saved[k]
        if isinstance(t, dict):
            _fill(t, s, f"{key}.", where)
            continue
        local = t.to_local() if DTensor is not None and isinstance(t, DTensor) else t
        if isinstance(local, torch.Tensor):
            if not isinstance(s, torch.Tensor) or s.shape != local.shape or s.dtype != local.dtype:
                got = f"{s.dtype} {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s)
                raise CorruptCheckpointError(
                    f"{where}: '{key}' was saved as {got}, the module has {local.dtype} "
                    f"{tuple(local.shape)} here; the local tier restores only the layout that "
                    "saved it: load from the save folder instead"
                )
            local.copy_(s)
        else:
            target[k] = s
