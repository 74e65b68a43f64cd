"""The node-local tier (docs/design.md §9): each rank saves its own part to its node's disk,
replicas go to peers on other nodes, a two-phase commit with no shared place decides what
counts, and a coverage vote finds the newest step the live ranks can assemble.

This module is the orchestration; the pieces it drives are `layout.py` (folders and records),
`part_write.py` / `part_read.py` / `part_check.py` (a part written, streamed, checked),
`transfer.py` (pipelined copies between ranks), `receive.py` (a missing part fetched from a
holder), `retention.py` (what a disk keeps) and `module_state.py` (local shards in and out).

Save (all ranks, the checkpointer's CPU group):
1. Rank 0 picks an attempt id. Each rank writes its part (module state, cut into pieces
   flushed in parallel when it is large, trainer state, then `part.json` with the size and
   CRC32C of every file), each file and folder fsynced.
2. Each part is sent in pipelined chunks (`local/transfer.py`) to `replication_factor - 1`
   holders on other disks, `replication_jump` ranks apart; each holder writes it durably (past
   the page cache only where its disk measured faster so, `replica_file.py`) and checks every
   CRC32C against the owner's `part.json`. The ranks agree that every part and replica is
   durable and intact (phase 1).
3. Only then each rank writes its commit marker naming step, attempt and the parts it holds
   (phase 2) and lists its disk, and the ranks agree again, sharing those lists in the same
   round: the save is committed.
4. From those lists the ranks count the steps they can restore (the coverage vote); the save
   is then done. A save takes three collective rounds at replication factor 1 (the attempt
   id, phase 1 with the parts' records, phase 2 with the lists), four with replicas.
   One rank per disk deletes the steps beyond the `keep` newest restorable ones, markers
   first, on a thread of its own (`retention.py`); the tier's next call and `close()` wait for
   it. A step that lost a part never displaces a restorable one.

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
import threading
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainckpt.core import dist
from trainckpt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
)
from trainckpt.local.layout import (
    Holding,
    LocalCommit,
    LocalPart,
    commit_file,
    new_attempt_id,
    part_dir,
    read_node_id,
    scan,
    write_local_record,
)
from trainckpt.local.part_check import PrivateCopy, copy_own, load_part
from trainckpt.local.part_read import PartReader
from trainckpt.local.part_write import PartThreads, PartWriter, write_own_part
from trainckpt.local.receive import Placement, receive_missing
from trainckpt.local.replica_file import decide, read_mode
from trainckpt.local.retention import clean_leftovers, start_retention
from trainckpt.local.transfer import PhaseClock, Transfer, exchange
from trainckpt.storage.local import writing
from trainckpt.testing.faults import fault_point

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
    _direct: bool = field(default=False, init=False)
    """Replicas are written past the page cache on this rank's disk (`replica_file.decide`)."""
    _retention: threading.Thread | None = field(default=None, init=False)
    """The deletions after the last commit (this rank leads its disk), while training goes on."""
    _deleting: bool = field(default=False, init=False)
    """A save committed since the last `open`: some disk's first rank may still be deleting
    (the same on every rank)."""
    _threads: PartThreads | None = field(default=None, init=False)
    """The threads the own parts are written with, started by the first save."""

    # -- start-up -------------------------------------------------------------------------------
    def open(self, *, synced: bool = False) -> None:
        """Learn which ranks share a disk and clean crashed leftovers (once per job).

        Called on: all ranks (every save and restore calls it first; after a save, every rank
        waits here until each disk's deletions are done, so no rank reads or writes a disk
        while they run). `synced`: the caller's next collective is an all-gather, which no
        rank leaves before every rank entered it: it stands in for the barrier here."""
        self.wait_for_retention()
        if self._deleting:
            self._deleting = False
            if not synced:
                dist.barrier(self.group)
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
            clean_leftovers(self.root)
            try:
                decide(self.root)
            except Exception as e:  # costs only speed: replicas go through the page cache
                log.warning(
                    "local tier: could not time replica writes under '%s': %s", self.root, e
                )
        dist.barrier(self.group)
        mode = read_mode(self.root)
        self._direct = mode is not None and mode.direct

    def _placement(self) -> Placement:
        return Placement(self.root, self.group, self._disks)

    def _is_disk_leader(self) -> bool:
        rank = dist.get_rank(self.group)
        return self._disks.index(self._disks[rank]) == rank

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
        self.open(synced=True)
        rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
        with clock("agree"):  # rank 0's id; an all-gather: also the barrier `open` left out
            attempt = dist.all_gather_object(new_attempt_id() if rank == 0 else "", self.group)[0]
        what = f"local checkpoint step {step} (attempt {attempt}) under '{self.root}'"
        part: LocalPart | None = None
        error: Exception | None = None
        try:
            part = write_own_part(
                self.root,
                rank,
                step,
                attempt,
                state,
                trainer_bytes,
                world,
                clock,
                self._part_threads(),
            )
        except Exception as e:
            error = e
        with clock("agree"):  # phase 1 of the own parts, and their records, in one round
            parts: list[LocalPart] = dist.agree_gather(part, error, f"writing {what}", self.group)  # type: ignore[arg-type]

        transfers = [
            Transfer(src=owner, dst=h, owner=owner, size=parts[owner].size)
            for owner in range(world)
            for h in self.holders(owner)
        ]
        self._warn_thin_replication(transfers, world)
        replication = time.perf_counter()
        if transfers:  # the same list on every rank: with none, no rank has more to agree on
            failures = exchange(
                transfers,
                self.group,
                open_source=lambda t: PartReader(part_dir(self.root, step, attempt, t.owner), part),
                open_sink=lambda t: PartWriter(
                    self.root,
                    part_dir(self.root, step, attempt, t.owner),
                    parts[t.owner],
                    self._direct,
                ),
                clock=clock,
            )
            with clock("agree"):
                failure = _first_failure(failures, transfers, what)
                dist.agree(failure, f"replicating {what}", self.group)
        replication = time.perf_counter() - replication

        fault_point("local-between-phases")
        held = sorted({rank, *(t.owner for t in transfers if t.dst == rank)})
        error = None
        holdings: list[Holding] = []
        with clock("marker"):
            try:
                marker = LocalCommit(
                    step=step, attempt=attempt, world_size=world, holder=rank, parts=held
                )
                write_local_record(commit_file(self.root, step, attempt, rank), marker)
                holdings, _ = scan(self.root)  # for the coverage vote, in the commit's round
            except Exception as e:
                error = e
        with clock("agree"):  # phase 2 and the coverage vote's inventory in one round
            inventory = dist.agree_gather(
                holdings, error, f"committing {what} (or listing its disk)", self.group
            )
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
                },
                "local_save_cpu_seconds": {name: clock.cpu.get(name, 0.0) for name in PHASES},
            },
        )
        restorable = {s for s, _a in self._coverage(inventory)}
        if self._is_disk_leader():
            self._retention = start_retention(self.root, step, restorable, self.keep)
        self._deleting = True
        return attempt

    def wait_for_retention(self) -> None:
        """Wait until the deletions after the last commit are done. Called on: any rank (the
        tier's calls, and `close`)."""
        if self._retention is not None:
            self._retention.join()
            self._retention = None

    def close(self) -> None:
        """Wait for the last save's deletions: a process may exit right after. Called on: each
        rank, by `Checkpointer.close()`."""
        self.wait_for_retention()
        if self._threads is not None:
            self._threads.close()
            self._threads = None

    def _part_threads(self) -> PartThreads:
        if self._threads is None:
            self._threads = PartThreads()
        return self._threads

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
        return self._coverage(self._inventory())

    def _coverage(self, inventory: list[list[Holding]]) -> list[tuple[int, str]]:
        """`covered` from every rank's holdings (`_inventory`, or a save's commit round).
        Called on: all ranks, with the same inventory."""
        world = dist.get_world_size(self.group)
        owners: dict[tuple[int, str], set[int]] = {}
        sizes: dict[tuple[int, str], set[int]] = {}
        for held in inventory:
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
            got: PrivateCopy | None = None
            try:
                got = copy_own(own, files)
            except FileNotFoundError:
                log.info("local tier: rank %d's part of step %d is not on this disk", rank, step)
            except Exception as e:  # any failure of this rank's read: the others go on below
                log.warning("local tier: own copy of rank %d's part is unusable: %s", rank, e)
            copy = receive_missing(self._placement(), step, attempt, got, files)
            fault_point("local-restore-checked")
            try:
                state, trainer = load_part(copy)
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
    "write wait",
    "receive close",
    "marker",
)
"""The phases of a local save, as its log line and `local_save_seconds` name them: own part
(`serialize`: torch.save's own work; `crc`; `write`: into the page cache; `fsync`: waiting for
the fsyncs of the pieces still running once all is written, then `part.json` and folders),
`agree` (the collectives of the two phases), replication (see `exchange`; `receive write` runs
on a writer thread, overlapping the other replication phases), and the commit `marker`.
Retention deletes after the commit, on a thread of its own (its log lines time it)."""


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
