"""Restoring a part this rank's disk does not hold intact: a checked copy received from a holder
on another disk, one holder per round, every byte CRC32C-checked as it is written. Parts are
found by owner rank, never by node. Called on: all ranks, together."""

from __future__ import annotations

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from trainckpt.core import dist
from trainckpt.errors import CheckpointError, CorruptCheckpointError
from trainckpt.local.layout import (
    PART_FILE,
    LocalPart,
    attempt_dir,
    part_dir,
    read_local_record,
    scan,
)
from trainckpt.local.part_check import PrivateCopy
from trainckpt.local.part_read import PartReader
from trainckpt.local.transfer import Sink, Transfer, exchange
from trainckpt.storage.local import writing

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where the parts of one job's local tier live: its folder (the same path on every node),
    its process group, and the disk id of each rank (ranks with the same id share a disk)."""

    root: Path
    group: dist.ProcessGroup | None
    disks: list[str]


def receive_missing(
    placement: Placement, step: int, attempt: str, got: PrivateCopy | None, files: ExitStack
) -> PrivateCopy:
    """The checked private copy of this rank's part to load: `got`, made from the own copy,
    or else one received from a holder on another disk (in chunks, every byte CRC32C-checked
    against the holder's record as it is written; memory is the transfer's chunk buffers,
    not the part). One holder per round until every rank's part is intact or some part has
    no holder left. The copies are closed with `files`. Called on: all ranks."""
    rank = dist.get_rank(placement.group)
    records = _part_records(placement, step, attempt)
    tried: dict[int, set[int]] = {}
    sinks: dict[int, PrivateCopy] = {}  # this round's copy by holder it comes from
    while True:
        need = dist.all_gather_object(got is None, placement.group)
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
                if h not in seen and placement.disks[h] != placement.disks[owner]
            ]
            if not options:
                lost.append(owner)
                continue
            seen.add(options[0])
            size = next(p.size for h, p in records[owner] if h == options[0])
            transfers.append(Transfer(src=options[0], dst=owner, owner=owner, size=size))
        if lost:
            raise CorruptCheckpointError(
                f"local checkpoint step {step} (attempt {attempt}) under '{placement.root}': no "
                f"intact copy left of the parts of ranks {lost} (see the warnings above); "
                "an older step or the save folder must be used"
            )
        sinks.clear()

        def open_sink(t: Transfer) -> Sink:
            expected = next(p for h, p in records[t.owner] if h == t.src)
            folder = attempt_dir(placement.root, step, attempt)  # gone with a wiped disk
            with writing(folder):
                folder.mkdir(parents=True, exist_ok=True)
            source = part_dir(placement.root, step, attempt, t.owner)
            sink = PrivateCopy(folder, expected, f"rank {t.src}'s '{source}'")
            sinks[t.src] = files.enter_context(sink)
            return sink

        failures = exchange(
            transfers,
            placement.group,
            open_source=lambda t: PartReader(
                part_dir(placement.root, step, attempt, t.owner),
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


def _part_records(
    placement: Placement, step: int, attempt: str
) -> dict[int, list[tuple[int, LocalPart]]]:
    """Each owner's holders of `step`/`attempt` with the `part.json` each holds, in rank
    order, one holder per disk. Called on: all ranks."""
    mine: list[LocalPart] = []
    for h in scan(placement.root)[0]:
        if (h.step, h.attempt) == (step, attempt):
            try:
                folder = part_dir(placement.root, step, attempt, h.owner)
                mine.append(read_local_record(folder / PART_FILE, LocalPart))
            except (CheckpointError, OSError) as e:
                log.warning("local tier: %s", e)
    out: dict[int, list[tuple[int, LocalPart]]] = {}
    disks_seen: dict[int, set[str]] = {}
    for holder, parts in enumerate(dist.all_gather_object(mine, placement.group)):
        for p in parts:
            if placement.disks[holder] not in disks_seen.setdefault(p.owner, set()):
                disks_seen[p.owner].add(placement.disks[holder])
                out.setdefault(p.owner, []).append((holder, p))
    return out
