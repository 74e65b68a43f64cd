"""Incremental saves (docs/incremental.md): data unchanged since the previous save costs no
bytes written and none uploaded, and every checkpoint stays a complete DCP folder.

Each rank remembers (`History`, in memory, one per `Checkpointer`) the shard files of its last
committed save: for each item its key (DCP index and tensor kind), the xxh3-128 hash of its
bytes (`content_hash.py`), offset and length. At the next save (`Session.lay_out`), on the
same rank:

1. every tensor item is hashed (in full: the hash decides; see "What is hashed" in
   docs/incremental.md for why no version counter is trusted to skip it), but one the last
   saves found changed is written without waiting for its hash, hashed while the files are
   written for the next save to compare, and, once it kept changing for more than four saves,
   hashed only at two saves in a row out of `HASH_PERIOD` (`hash_due`): a hint only decides
   when an item is hashed, never that it is unchanged;
2. a previous file whose every item is present again with the same key and hash is taken over
   as it is: hard-linked (or copied) into `-tmp`, or copied server-side into the claimed prefix
   (`Storage.copy_file`), then checked by its size and item record (it names the file and the
   save that wrote it, which this save's `.metadata` then also names);
3. the other unchanged items (and, with no record yet, items that look frozen: model entries the
   optimizer holds no state for) fill files of their own, so that the next save can take those
   over whole; changed items fill the rest.

A file that cannot be taken over (the previous checkpoint was deleted meanwhile, or its file is
not the one recorded) is written instead. The taken-over file is an independent name for the
same bytes: deleting either checkpoint never affects the other.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import operator
import threading
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

import torch

from trainckpt.errors import CheckpointError, CheckpointNotFoundError
from trainckpt.format import plain_values, shard_checksums
from trainckpt.format.content_hash import (
    LARGE_ITEM,
    StorageDigests,
    StorageKey,
    bytes_digest,
    item_digest,
    storage_key,
    tensor_digest,
    tensor_kind,
)
from trainckpt.format.tensor_item import small_item
from trainckpt.identity import identity
from trainckpt.storage import Storage
from trainckpt.storage.checksums import FileEntry
from trainckpt.testing.faults import fault_point

if TYPE_CHECKING:  # DCP loads with the first save; `History` is built with the Checkpointer
    from torch.distributed.checkpoint.planner import WriteItem
    from torch.distributed.checkpoint.storage import WriteResult

    from trainckpt.format.shard_writer import ItemData, Layout, Shard, WrittenShard

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavedFile:
    """One shard file of a committed save of this rank."""

    name: str
    """Its name in the DCP folder (what its item record names)."""
    rel: str
    """Its path relative to the checkpoint folder."""
    save_id: str
    """The save that wrote its bytes (named by its item record)."""
    entry: FileEntry
    pairs: list[tuple[Hashable, bytes | None]] = field(repr=False)
    """Its items' (key, hash) in file order, the very pairs the save that wrote it laid out
    (compared by identity first, `unchanged_at`). A key is DCP's index of the item and its
    tensor kind (equal keys hold bytes of equal layout; `_ITEM` for a small tensor, whose item
    bytes are hashed), a hash the xxh3-128 of its bytes, or None for an item not hashed (by
    the schedule, `hash_due`, or never: a subclass...)."""
    spans: list[tuple[int, int]] = field(repr=False)
    """Its items' (offset, length) in the file."""
    _where: list[Any] = field(default_factory=list, compare=False, repr=False)
    """[a plan's items, its items' positions in that plan], for `positions_in`."""

    @functools.cached_property
    def keys(self) -> list[Hashable]:
        """Its items' keys, in order."""
        return list(map(operator.itemgetter(0), self.pairs))

    @functools.cached_property
    def digests(self) -> list[bytes | None]:
        """Its items' hashes, in order."""
        return list(map(operator.itemgetter(1), self.pairs))

    def positions_in(self, plan: _Plan) -> list[int] | None:
        """Its items' positions in `plan`, None if one is not in it (found once per plan)."""
        where = self._where
        if not where or where[0] is not plan.items:
            found = list(map(plan.where.get, map(_WHERE, cast("list[tuple[Any, ...]]", self.keys))))
            where[:] = [plan.items, None if None in found else found]
        return cast("list[int] | None", where[1])

    def unchanged_at(self, plan: _Plan, keyed: list[tuple[Hashable, bytes | None] | None]) -> bool:
        """True when every item of this file is laid out again (`keyed`, by position in
        `plan`) with the same key and hash (by C loops: a file of hyperparameters holds tens
        of thousands of items, whose pairs are the very objects of the last save)."""
        positions = self.positions_in(plan)
        return (
            positions is not None
            and bool(positions)
            and None not in self.digests
            and list(_at(keyed, positions)) == self.pairs
        )


@dataclass(frozen=True)
class _Committed:
    storage: Storage
    dir: str
    files: tuple[SavedFile, ...]

    @functools.cached_property
    def known(self) -> dict[Hashable, bytes | None]:
        """Every item's hash, by key."""
        return dict(itertools.chain.from_iterable(f.pairs for f in self.files))


class _Plan:
    """What a save's layout needs of each item that depends only on the plan (DCP's items
    list, handed out again while the plan is reused: `core/plan_cache.py`), by position."""

    def __init__(self, items: list[WriteItem]) -> None:
        self.items = items  # held: compared by identity
        self.index: list[tuple[str, Any]] = [(i.index.fqn, i.index.offset) for i in items]
        self.tensor = [i.tensor_data is not None for i in items]
        self.large = [_nbytes(i) >= LARGE_ITEM for i in items]
        self.any_large = any(self.large)
        self.position = {identity(item): n for n, item in enumerate(items)}
        self.where = dict(zip(self.index, range(len(items)), strict=True))
        """Each item's position by its (fqn, offset)."""
        self.hyper = [i.index.fqn.startswith(_HYPER) for i in items]
        self.tensor_index = [w if t else None for w, t in zip(self.index, self.tensor, strict=True)]
        """Each tensor item's (fqn, offset), as `History.changing` has it; None for byte items."""
        self.bytes = [n for n, t in enumerate(self.tensor) if not t]
        """The positions of the byte items."""
        self.byte_items = [items[n] for n in self.bytes]
        self.positions = range(len(items))
        self.plain_key = [
            (*w, None if t else "bytes") for w, t in zip(self.index, self.tensor, strict=True)
        ]
        """Each item's key where it needs no data: a byte item's, and a tensor item's when it
        is not hashed (made once per plan: a state of many entries has tens of thousands)."""
        self.byte_keys: list[Hashable] = [self.plain_key[n] for n in self.bytes]
        self.byte_fqns = [items[n].index.fqn for n in self.bytes]
        self._frozen: set[str] | None = None

    def first_hint(self) -> dict[tuple[str, Any], int]:
        """The hint of a save with no previous one (`History.changing`, a streak of 0: due):
        the tensor items it writes as changed whatever their hash (all but the likely frozen),
        hashed while they are written, for the next save to compare, not before."""
        frozen = self.likely_frozen()
        return {
            where: 0 for where in self.tensor_index if where is not None and where[0] not in frozen
        }

    def likely_frozen(self) -> set[str]:
        """`_likely_frozen` of the plan's entries (made on first use)."""
        if self._frozen is None:
            self._frozen = _likely_frozen([i.index.fqn for i in self.items])
        return self._frozen


class _ByteItems(NamedTuple):
    """A save's byte items, in plan order (`_Plan.bytes`)."""

    keys: list[Hashable]
    """`_Plan.byte_keys` of the plan they were made for (compared by identity)."""
    sources: list[Any]
    """Each item's state value if an immutable plain value (`plain_values.value_key`), else
    `_UNKNOWN`."""
    data: list[ItemData]
    """Each item's bytes as resolved (held: an id is not reused meanwhile)."""
    keyed: list[tuple[Hashable, bytes | None] | None]


_UNKNOWN = object()
"""Kept for a state value that is not an immutable plain value (`_ByteItems.sources`): never
the same as a value `values_of` returns."""


class _Results(NamedTuple):
    """Every item's result of a save (the list handed to DCP), and what decided them: the
    plan, the files taken over, and the files written with their items and places. A save
    whose layout is the same, item for item, hands out the very same list again: no result is
    built, and the metadata files are then known unchanged by identity (`metadata_files`)."""

    items: list[WriteItem]
    placed: list[SavedFile]
    written: list[tuple[str, list[WriteItem], list[tuple[int, int]]]]
    per_file: list[list[WriteResult]]
    """The results of each written file (plain `WriteResult`s, no save named)."""
    results: list[WriteResult]


class History:
    """This rank's record of the shard files of its last committed save; kept in memory by a
    `Checkpointer` (a restarted run starts with a full save). Called on: each rank, from the
    thread running its saves."""

    def __init__(self) -> None:
        self._last: _Committed | None = None
        self._pending: list[SavedFile] = []
        self._lock = threading.Lock()
        self.digests = StorageDigests()
        """Shared with the `Stager` of async saves (`content_hash.StorageDigests`)."""
        self.changing: dict[tuple[str, Any], int] = {}
        """(fqn, offset) of the tensor items the last save wrote as changed, each with the
        number of saves in a row that did so: a hint, for the next save to write them without
        waiting for their hash, and to hash them only when `hash_due` (`Session.lay_out`)."""
        self.late_storages: frozenset[StorageKey] = frozenset()
        """The large storages of those the next save hashes: its `Prehash` hashes them last."""
        self.unhashed_storages: frozenset[StorageKey] = frozenset()
        """The large storages of those the next save does not hash: its `Prehash` skips them."""
        self.byte_items = _ByteItems([], [], [], [])
        """The last save's byte items (`Session._keyed_bytes`)."""
        self.file_results: dict[int, tuple[SavedFile, list[WriteItem], list[WriteResult]]] = {}
        """The results of every file of the last save (taken over or written), by id of its
        `SavedFile` (each held), with the plan they were made for."""
        self.last_results: _Results | None = None
        """Every result of the last save, and the layout they describe (`Session.record`)."""
        self.last_groups: list[list[WriteItem]] = []
        """The groups of items the last save wrote (`Session.lay_out`)."""
        self._plan: _Plan | None = None

    def plan(self, items: list[WriteItem]) -> _Plan:
        """What is kept of the plan `items` (made anew for a new plan)."""
        plan = self._plan
        if plan is None or plan.items is not items:
            plan = self._plan = _Plan(items)
        return plan

    def may_hold_large(self) -> bool:
        """False when the last plan held no large tensor item: the next save's `Prehash`
        would walk the whole state (tens of thousands of entries) to find none. If one
        appears, the layout hashes it itself (`_hash_large`)."""
        return self._plan is None or self._plan.any_large

    def previous(self, storage: Storage) -> _Committed | None:
        """The last committed save, if it went to the same kind of storage."""
        last = self._last
        return last if last is not None and type(last.storage) is type(storage) else None

    def begin(self) -> None:
        """A save starts: forget what an unfinished one recorded."""
        with self._lock:
            self._pending = []

    def add(self, files: list[SavedFile]) -> None:
        with self._lock:
            self._pending.extend(files)

    def committed(self, storage: Storage, dir: str) -> None:
        """The save that recorded its files since `begin` is committed as `dir`."""
        with self._lock:
            self._last = _Committed(storage, dir, tuple(self._pending))
            self._pending = []


@dataclass(frozen=True)
class Reuse:
    """Where a save puts the files it takes over unchanged from the previous checkpoint
    (`incremental.py`): a hard link into `-tmp`, or a server-side copy into the claimed prefix,
    instead of writing (and uploading) them."""

    storage: Storage
    into: str
    """The location standing for the checkpoint folder: `-tmp`, or the step's prefix."""
    done: set[str] = field(default_factory=set)
    """Paths (relative to the checkpoint) of the files placed so far: none is uploaded."""


class Session:
    """One rank's incremental save: lays its items out (`lay_out`), takes unchanged files over
    through `reuse`, and records what it wrote in `history` (`record`). `prefix`: the DCP
    folder relative to the checkpoint folder ("" or "model_and_optim/")."""

    def __init__(
        self, history: History, reuse: Reuse, prefix: str, state: dict[str, Any] | None = None
    ) -> None:
        """`state`: the state dict this save writes (live, or the staged copy of an async
        save; it does not change while the save runs): its large tensors start being hashed
        now, on other threads, while DCP plans (`Prehash`), those the last save found
        changed last."""
        self.history = history
        self.reuse = reuse
        self.prefix = prefix
        self._prehash = (
            Prehash(state, history.digests, history.late_storages, history.unhashed_storages)
            if state and history.may_hold_large()
            else None
        )
        self._plan: _Plan | None = None
        self._keyed: list[tuple[Hashable, bytes | None] | None] = []
        self._late: list[int] = []
        self._late_hashed: Future[None] | None = None
        self._hint: dict[tuple[str, Any], int] = {}  # `History.changing` as this save used it
        self._changed: dict[tuple[str, Any], StorageKey | None] = {}  # written as changed
        self._storages: dict[int, StorageKey] = {}  # item number -> storage, if prehashed
        self._previous: _Committed | None = None
        self._placed: list[SavedFile] = []
        self._reused: list[WriteResult] = []  # the results of the files taken over
        history.begin()

    def lay_out(
        self,
        items: list[WriteItem],
        resolve: Callable[[WriteItem], ItemData],
        threads: int,
        values_of: Callable[[list[str]], list[Any]] | None = None,
    ) -> Layout:
        """Hash the items that may be unchanged, take over the previous files whose items are
        all unchanged, and group the rest: unchanged (or likely frozen) items, then the
        others. `values_of`: the state values behind byte items, by fqn, if the planner can
        tell (`_keyed_bytes`). Called on: each rank, in DCP's `write_data`.

        A tensor item the last save wrote as changed (`History.changing`, a hint) is written
        without waiting for its hash: it goes with the changed items, and is hashed while the
        files are written (`record` waits for it), for the next save to compare, or, when it
        is not `hash_due`, not hashed at all. A hint never makes an item unchanged: only equal
        hashes do. Keys are plain tuples (fqn, offset, kind), hashed in C; what depends only on
        the plan is kept with it (`_Plan`)."""
        from trainckpt.format.shard_writer import Layout, ReusedResult, write_results

        history = self.history
        plan = self._plan = history.plan(items)
        previous = self._previous = history.previous(self.reuse.storage)
        hint = self._hint = history.changing if previous is not None else plan.first_hint()
        keyed = self._keyed = [None] * len(items)
        storages = self._storages
        # by positions in `items`, each list made by C loops: a state has tens of thousands
        hinted_flags = list(map(hint.__contains__, plan.tensor_index))
        hinted = _where(hinted_flags, plan.positions)
        rest = _where(map(operator.not_, hinted_flags), plan.positions)
        due = {streak: hash_due(streak) for streak in set(hint.values())}
        dues = list(map(due.__getitem__, map(hint.__getitem__, _at(plan.index, hinted))))
        late = _where(dues, hinted)
        unhashed = _where(map(operator.not_, dues), hinted)
        # written as changed, with no hash or kind: never taken unchanged
        _put(keyed, unhashed, zip(_at(plan.plain_key, unhashed), itertools.repeat(None)))
        for n in _where(_at(plan.large, unhashed), unhashed):
            data = resolve(items[n])  # for the next save's `Prehash` to skip, if not due either
            if isinstance(data, torch.Tensor):
                storages[n] = storage_key(data)
        _put(keyed, plan.bytes, self._keyed_bytes(resolve, values_of))
        large: list[int] = []
        for n in _where(_at(plan.tensor, rest), rest):
            if plan.large[n]:
                large.append(n)
            else:
                keyed[n] = _keyed_small(plan.index[n], resolve(items[n]))
        _hash_large(items, large, resolve, threads, keyed, self._prehash, storages, urgent=True)
        # the small ones are hashed by the writers, from the item bytes they make anyway
        self._late, late = late, _where(_at(plan.large, late), late)
        candidates = [
            f
            for f in (previous.files if previous is not None else ())
            if f.rel == self.prefix + f.name and f.unchanged_at(plan, keyed)
        ]
        layout = Layout(groups=[])
        placed = self._placed = self._take_over(previous, candidates, threads) if previous else []
        taken = [False] * len(items)  # by position: the items of the files taken over
        results = history.file_results
        history.file_results = {}
        for f in placed:
            layout.reused_files[f.name] = f.entry
            positions = f.positions_in(plan)
            assert positions is not None
            kept = results.get(id(f))
            if kept is None or kept[0] is not f or kept[1] is not items:
                kept = (f, items, write_results(list(_at(items, positions)), f.name, f.spans))
            rows = kept[2]
            first = rows[0]
            if type(first) is not ReusedResult or first.source_save_id != f.save_id:
                # a file the last save wrote: its results then, the first naming that save
                head = write_results([items[positions[0]]], f.name, f.spans[:1], f.save_id)
                rows = head + rows[1:]
                kept = (f, items, rows)
            history.file_results[id(f)] = kept
            self._reused += rows
            _put(taken, positions, itertools.repeat(True))
        stable: list[int] = []
        hyper: list[int] = []  # hyperparameters unchanged (or seen for the first time)
        changing = list(hinted)  # the late ones are compared in `record`
        changed = self._changed
        changed.update(zip(_at(plan.index, unhashed), map(storages.get, unhashed), strict=True))
        unchanged: dict[StorageKey, bytes] = {}  # storage -> hash of the items found unchanged
        ready = cast("list[tuple[Hashable, bytes | None]]", keyed)  # keyed at `rest`, `storages`
        for n in _where(map(operator.not_, _at(taken, rest)), rest):
            key, digest = ready[n]
            if digest is None:
                same = False
            elif key in self._known():
                same = self._known()[key] == digest
            else:
                same = plan.hyper[n] or plan.index[n][0] in plan.likely_frozen()
            if same:
                (hyper if plan.hyper[n] else stable).append(n)
                if n in storages and digest is not None:
                    unchanged[storages[n]] = digest
            else:
                changing.append(n)
                if plan.tensor[n]:
                    changed[plan.index[n]] = storages.get(n)
        for n, where in storages.items():  # the large tensors of the files taken over
            digest = ready[n][1]
            if taken[n] and digest is not None:
                unchanged[where] = digest
        changing.sort()
        # for the next async staging: the storages worth hashing there to skip their copy (a
        # trained state has none, and so pays no hash at staging)
        history.digests.hashed = unchanged
        groups = [list(map(items.__getitem__, g)) for g in (stable, hyper, changing) if g]
        last_groups = {len(g): g for g in history.last_groups}
        for n, group in enumerate(groups):  # as last time: the same list (its files are kept)
            before = last_groups.get(len(group))
            if before is not None and _same_items(before, group):
                groups[n] = before
        layout.groups = history.last_groups = groups
        history.add(placed)
        if late:
            pool = ThreadPoolExecutor(1, thread_name_prefix="trainckpt-hash")
            self._late_hashed = pool.submit(
                _hash_large, items, late, resolve, threads, keyed, self._prehash, storages, False
            )
            pool.shutdown(wait=False)
        else:
            self._prehash = None
        return layout

    def _keyed_by_writer(self, positions: list[int], digests: list[bytes | None] | None) -> None:
        """Key the small tensor items the layout left unhashed (those the last save found
        changed) by the digests the writer made of their item bytes (`_keyed_small`); one it
        did not hash is never taken for unchanged."""
        plan, keyed = self._plan, self._keyed
        assert plan is not None
        unkeyed = map(operator.is_, _at(keyed, positions), itertools.repeat(None))
        waiting = _where(unkeyed, positions)
        if not waiting:
            return
        found = dict(zip(positions, digests, strict=True)) if digests is not None else {}
        for n in waiting:
            digest = found.get(n)
            if digest is None:
                keyed[n] = (plan.plain_key[n], None)
            else:
                keyed[n] = ((*plan.index[n], _ITEM), digest)

    def _known(self) -> dict[Hashable, bytes | None]:
        """Every item's hash in the last committed save, by key (made on first use: a save
        that compares no item by its hash does not need it)."""
        previous = self._previous
        return previous.known if previous is not None else {}

    def _keyed_bytes(
        self,
        resolve: Callable[[WriteItem], ItemData],
        values_of: Callable[[list[str]], list[Any]] | None,
    ) -> list[tuple[Hashable, bytes | None]]:
        """(key, hash) of each byte item of the plan (`_Plan.bytes`). An item whose state value
        (`values_of`) is the very immutable plain value it was at the last save keeps that
        save's (key, hash) without being resolved: its bytes depend on the value alone
        (`plain_values`), and a state of many entries has tens of thousands of them. The
        others are resolved and hashed once per distinct bytes object."""
        plan = self._plan
        assert plan is not None
        count = len(plan.bytes)
        last = self.history.byte_items
        if last.keys is not plan.byte_keys:
            last = _ByteItems(plan.byte_keys, [_UNKNOWN] * count, [b""] * count, [None] * count)
        if values_of is None:
            sources, same = [_UNKNOWN] * count, [False] * count
        else:
            sources = values_of(plan.byte_fqns)
            same = list(map(operator.is_, sources, last.sources))
        if all(same):
            return cast("list[tuple[Hashable, bytes | None]]", last.keyed)
        # the last save's data are held until here: an equal identity is the same object
        digest_of = {
            identity(d): k[1]
            for d, k in zip(last.data, last.keyed, strict=True)
            if k and type(d) is bytes
        }
        kept, data, keyed = list(last.sources), list(last.data), list(last.keyed)
        for i in [i for i, s in enumerate(same) if not s]:
            value = data[i] = resolve(plan.byte_items[i])
            if type(value) is bytes:  # immutable: the same object, the same hash
                digest = digest_of.get(identity(value))
                if digest is None:
                    digest = digest_of[identity(value)] = bytes_digest(value)
            else:
                digest = None if isinstance(value, torch.Tensor) else bytes_digest(value)
            keyed[i] = (plan.byte_keys[i], digest)
            source = sources[i]
            kept[i] = source if plain_values.value_key(source) is not None else _UNKNOWN
        self.history.byte_items = _ByteItems(plan.byte_keys, kept, data, keyed)
        return cast("list[tuple[Hashable, bytes | None]]", keyed)

    def record(
        self, shards: Sequence[Shard], written: Sequence[WrittenShard], save_id: str
    ) -> list[WriteResult]:
        """Remember the files this rank wrote in this save, with every item's hash (waiting
        for those hashed while the files were written), and return every item's result: the
        last save's list when the layout is the same (`_Results`). Called on: each rank, after
        its shards are written."""
        if self._late_hashed is not None:
            self._late_hashed.result()
            self._late_hashed = self._prehash = None
        plan = self._plan
        assert plan is not None
        keyed, position = self._keyed, plan.position
        files = []
        for shard, done in zip(shards, written, strict=True):
            positions = list(map(position.__getitem__, map(identity, shard.items)))
            self._keyed_by_writer(positions, done.digests)
            ones = cast("list[tuple[Hashable, bytes | None]]", list(_at(keyed, positions)))
            assert len(ones) == len(done.spans) and None not in ones
            rel = self.prefix + shard.name
            where = [plan.items, positions]
            files.append(SavedFile(shard.name, rel, save_id, done.entry, ones, done.spans, where))
        self.history.add(files)
        # the hint for the next save: the tensor items written as changed in this one
        changed, known, storages = self._changed, self._known(), self._storages
        for n in self._late:
            one = keyed[n]
            assert one is not None
            if one[1] is None or known.get(one[0]) != one[1]:
                changed[plan.index[n]] = storages.get(n)
        # by C loops over `changed` (a state that trains in full: every tensor item)
        before = map(self._hint.get, changed, itertools.repeat(0))
        streaks = list(map(operator.add, before, itertools.repeat(1)))
        due = {streak: hash_due(streak) for streak in set(streaks)}
        dues = list(map(due.__getitem__, streaks))
        large = list(changed.values())  # the storages of the large ones, else None
        self.history.changing = dict(zip(changed, streaks, strict=True))
        self.history.late_storages = frozenset(filter(None, _where(dues, large)))
        self.history.unhashed_storages = frozenset(
            filter(None, _where(map(operator.not_, dues), large))
        )
        return self._results(shards, written, files)

    def _results(
        self, shards: Sequence[Shard], written: Sequence[WrittenShard], files: list[SavedFile]
    ) -> list[WriteResult]:
        """Every item's result: those of the files taken over, then those written (kept with
        each written file's `SavedFile`, for the save that takes it over). A file written
        as the last save wrote it (same plan, name, items by identity, places) keeps that
        save's results; when every file is as in the last save (the same `SavedFile`s taken
        over), the last save's very list is handed out again."""
        from trainckpt.format.shard_writer import write_results

        plan = self._plan
        assert plan is not None
        layout = [(d.name, s.items, d.spans) for s, d in zip(shards, written, strict=True)]
        history = self.history
        last = history.last_results
        before: dict[str, tuple[list[WriteItem], list[tuple[int, int]], list[WriteResult]]] = {}
        if last is not None and last.items is plan.items:
            before = {
                name: (items, spans, rows)
                for (name, items, spans), rows in zip(last.written, last.per_file, strict=True)
            }
        per_file = []
        for name, items, spans in layout:
            found = before.get(name)
            if found is not None and found[1] == spans and _same_items(found[0], items):
                per_file.append(found[2])
            else:
                per_file.append(write_results(items, name, spans))
        if (
            last is not None
            and len(last.per_file) == len(per_file)
            and all(map(operator.is_, last.per_file, per_file))
            and len(last.placed) == len(self._placed)
            and all(map(operator.is_, last.placed, self._placed))
        ):
            results = last.results
        else:
            results = list(self._reused)
            for rows in per_file:
                results += rows
            history.last_results = _Results(plan.items, self._placed, layout, per_file, results)
        for f, rows in zip(files, per_file, strict=True):
            history.file_results[id(f)] = (f, plan.items, rows)
        return results

    def _take_over(
        self, previous: _Committed, files: list[SavedFile], threads: int
    ) -> list[SavedFile]:
        """Place each of `files` of the `previous` checkpoint into this save; return those
        placed (a file that could not be is written instead)."""
        if not files:
            return []
        first = threading.Event()

        def place(f: SavedFile) -> bool:
            ok = self._place(previous.dir, f)
            if ok and not first.is_set():
                first.set()
                fault_point("reused-file")
            return ok

        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="trainckpt-reuse") as pool:
            placed = [f for f, ok in zip(files, pool.map(place, files), strict=True) if ok]
        log.info(
            "incremental save: took over %d of %d unchanged file(s) (%.1f MB) from '%s'",
            len(placed),
            len(files),
            sum(f.entry.size for f in placed) / 1e6,
            previous.dir,
        )
        return placed

    def _place(self, source_dir: str, f: SavedFile) -> bool:
        """Link or copy file `f` of `source_dir` into this save and check that it is the file
        recorded (size, item record); False, with nothing left behind, if not."""
        storage = self.reuse.storage
        src, dst = storage.join(source_dir, f.rel), storage.join(self.reuse.into, f.rel)
        try:
            storage.copy_file(src, dst)
            _check(storage, dst, f)
        except (CheckpointNotFoundError, FileNotFoundError) as e:  # deleted meanwhile
            log.info("incremental save: writing '%s' anew: %s", dst, e)
            return False
        except (CheckpointError, OSError) as e:
            log.warning(
                "incremental save: writing '%s' anew, it could not be taken over: %s", dst, e
            )
            try:
                storage.delete_files([dst])
            except CheckpointError as cleanup:
                log.warning("could not remove '%s': %s", dst, cleanup)
            return False
        self.reuse.done.add(f.rel)
        return True


def _check(storage: Storage, location: str, f: SavedFile) -> None:
    """Raise unless `location` holds file `f` as recorded: its size, and an item record that
    names it and the save that wrote it (a save id is unique: no other file has that record)."""
    size = storage.size(location)
    if size != f.entry.size:
        raise CheckpointError(f"'{location}' has {size} bytes, not the {f.entry.size} recorded")
    with storage.open_read(location) as stream:
        record = shard_checksums.read(stream, location)
    record.check_identity(location, f.name, frozenset([f.save_id]))


class Prehash:
    """Hashes the large plain CPU tensors of a state dict on background threads from the
    start of a save, so that the frozen base's hashing overlaps the rest of the save instead
    of preceding its writes: first those the save may take over (`urgent`), then those the
    last save found changed (`late`: the storages in `late`; they are written anyway, their
    hash only recorded), and none of those in `skipped` (written anyway, and not `hash_due`
    at this save). Results are found by storage (`StorageKey`): an item that resolves
    to the same storage holds the same bytes, since the state does not change while it is
    saved and the storages are held here until then. A staged buffer whose copy the stager
    skipped (`StorageDigests.vouched`: it holds the bytes hashed by the last save) is not
    hashed again. The hashes of the storages found unchanged (or likely frozen) are then
    published (`StorageDigests.hashed`, by `Session.lay_out`) for the next staging. Hashes
    bytes, trusts no version counter (docs/incremental.md). Called on: the saving thread."""

    def __init__(
        self,
        state: dict[str, Any],
        shared: StorageDigests,
        late: frozenset[StorageKey] = frozenset(),
        skipped: frozenset[StorageKey] = frozenset(),
    ) -> None:
        tensors: dict[StorageKey, torch.Tensor] = {}
        for t in _plain_tensors(state):
            if t.nbytes < LARGE_ITEM:  # a small item: hashed where it is laid out
                continue
            key = storage_key(t)
            if key not in tensors and tensor_kind(t) is not None:
                tensors[key] = t
        vouched = shared.vouched
        self._known = {k: vouched[k] for k in tensors if k in vouched}
        self._tensors = tensors
        self._urgent: list[Future[dict[StorageKey, bytes]]] = []
        self._later: list[Future[dict[StorageKey, bytes]]] = []
        self._waiting_later: set[StorageKey] = set()
        keys = sorted(k for k in tensors if k not in self._known and k not in skipped)
        if not keys:
            return
        urgent = [k for k in keys if k not in late]
        later = [k for k in keys if k in late]
        self._waiting_later = set(later)
        threads = min(PREHASH_THREADS, len(keys))
        pool = ThreadPoolExecutor(threads, thread_name_prefix="trainckpt-prehash")
        for keys, futures in ((urgent, self._urgent), (later, self._later)):
            for n in range(threads):  # in address order: memory read in sequence
                if keys[n::threads]:
                    futures.append(pool.submit(self._hash, keys[n::threads]))
        pool.shutdown(wait=False)

    def _hash(self, keys: list[StorageKey]) -> dict[StorageKey, bytes]:
        return {k: tensor_digest(self._tensors[k]) for k in keys}

    def urgent(self, wanted: Sequence[StorageKey]) -> dict[StorageKey, bytes]:
        """The hashes of the storages hashed first; every hash when one of `wanted` is among
        the others (a hint that no longer holds)."""
        done = dict(self._known)
        for future in self._urgent:
            done.update(future.result())
        if any(k in self._waiting_later for k in wanted):
            return self.digests()
        return done

    def digests(self) -> dict[StorageKey, bytes]:
        """Every hash, once all are computed."""
        done = dict(self._known)
        for future in (*self._urgent, *self._later):
            done.update(future.result())
        return done


_HYPER = "optim.param_groups."
"""The prefix of an optimizer's flattened hyperparameters (lr, betas, ...: one entry per
parameter and name): likely the same at the next save, so those unchanged, and those seen for
the first time, fill files of their own (neither with a frozen base, which a changing learning
rate would keep from being taken over, nor with the trained values, which change at every
save)."""

HASH_PERIOD = 8
"""A tensor item written as changed at more than four saves in a row is hashed only at two
saves in a row out of this many (`hash_due`)."""


def hash_due(streak: int) -> bool:
    """Whether a save hashes a tensor item that the saves before it wrote as changed `streak`
    times in a row. An item is found unchanged only by two saves in a row that hashed it (the
    second compares with the first's record). So it is hashed at the first four saves of a
    streak (an item that changed for a few steps is taken over again at once), then at two
    saves in a row out of `HASH_PERIOD`: a state that trains in full pays a quarter of its
    hashing, and an item that stops changing later is taken over again within about
    `HASH_PERIOD` saves. Only hashing is skipped: an item not hashed is written, never linked."""
    return streak <= 4 or streak % HASH_PERIOD in (0, 1)


PREHASH_THREADS = 2
"""Threads hashing a state's large tensors from the start of a save (xxh3 releases the
interpreter lock: two cores hash at twice the speed of one)."""


def _plain_tensors(state: Any) -> list[torch.Tensor]:
    """The plain tensors of a (nested) state dict, by a loop over each container's values
    (no call per entry: a fine-tune's state has thousands)."""
    out: list[torch.Tensor] = []
    todo = [state]
    tensor = torch.Tensor
    while todo:
        obj = todo.pop()
        values = obj.values() if isinstance(obj, dict) else obj
        for v in values:
            if type(v) is tensor:  # what `tensor_kind` accepts
                out.append(v)
            elif isinstance(v, (dict, list, tuple)):
                todo.append(v)
    if type(state) is tensor:
        out.append(state)
    return out


def _hash_large(
    items: list[WriteItem],
    which: list[int],
    resolve: Callable[[WriteItem], ItemData],
    threads: int,
    keyed: list[tuple[Hashable, bytes | None] | None],
    prehash: Prehash | None,
    storages: dict[int, StorageKey] | None,
    urgent: bool,
) -> None:
    """Set `keyed[n]` (`_keyed`) for each (large) item number in `which`: a tensor `prehash`
    hashed takes that hash (waiting for the `urgent` ones, or all; `storages` gets its
    storage), the other large ones are hashed on `threads` threads (xxh3 releases the
    interpreter lock), anything else here (`_keyed_small`)."""
    if not which:
        return
    found: list[tuple[int, torch.Tensor, Hashable, StorageKey]] = []
    rest: list[int] = []
    for n in which:
        item = items[n]
        data = resolve(item)
        kind = None
        if _nbytes(item) >= LARGE_ITEM and isinstance(data, torch.Tensor):
            kind = tensor_kind(data)
        if kind is None:  # small, a byte item, or a tensor never hashed
            keyed[n] = _keyed_small((item.index.fqn, item.index.offset), data)
            continue
        if prehash is None:
            rest.append(n)
            continue
        assert isinstance(data, torch.Tensor)
        found.append((n, data, _key(item, kind), storage_key(data)))
    if found:
        assert prehash is not None
        wanted = [where for *_, where in found]
        known = prehash.urgent(wanted) if urgent else prehash.digests()
        for n, _, key, where in found:
            digest = known.get(where)
            if digest is None:
                rest.append(n)
                continue
            keyed[n] = (key, digest)
            if storages is not None:
                storages[n] = where
    if rest:
        with ThreadPoolExecutor(max(1, threads), thread_name_prefix="trainckpt-hash") as pool:
            done = pool.map(lambda n: _keyed(items[n], resolve), rest)
            for n, one in zip(rest, done, strict=True):
                keyed[n] = one


_T = TypeVar("_T")
_WHERE = operator.itemgetter(0, 1)
"""The (fqn, offset) of an item's key."""


def _at(values: list[Any], positions: Iterable[int]) -> Iterator[Any]:
    """The values at `positions`, by a C loop."""
    return map(values.__getitem__, positions)


def _where(flags: Iterable[object], values: Iterable[_T]) -> list[_T]:
    """The values (positions, mostly) whose flag is true, by a C loop."""
    return list(itertools.compress(values, flags))


def _put(target: list[Any], positions: Iterable[int], values: Iterable[Any]) -> None:
    """`target[n] = value` for each position and value, by a C loop."""
    collections.deque(map(target.__setitem__, positions, values), maxlen=0)


def _same_items(a: list[WriteItem], b: list[WriteItem]) -> bool:
    """Whether two lists hold the very same items in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _nbytes(item: WriteItem) -> int:
    """The bytes of a tensor item's data, from its plan (0 for a byte item)."""
    data = item.tensor_data
    if data is None:
        return 0
    return data.size.numel() * data.properties.dtype.itemsize


def _key(item: WriteItem, kind: Hashable) -> Hashable:
    """An item's key: DCP's index (fqn and offset: what `MetadataIndex` compares) plus
    its kind, as a tuple hashed in C."""
    index = item.index
    return (index.fqn, index.offset, kind)


def _keyed(
    item: WriteItem, resolve: Callable[[WriteItem], ItemData]
) -> tuple[Hashable, bytes | None]:
    """(key, hash) of one item (`_keyed_data`)."""
    return _keyed_data((item.index.fqn, item.index.offset), resolve(item))


_ITEM = "item"
"""The kind in the key of a small tensor hashed by its item bytes (`_keyed_small`)."""


def _keyed_small(where: tuple[str, Any], data: ItemData) -> tuple[Hashable, bytes | None]:
    """(key, hash) of a small item at `where`: a plain small tensor's hash is that of the item
    bytes the shard writer writes for it (`tensor_item.small_item`: they fix its kind too), as
    the writers hash those they write (`WrittenShard.digests`); others as `_keyed_data`."""
    if isinstance(data, torch.Tensor):
        item = small_item(data)
        if item is not None:
            return (*where, _ITEM), item_digest(item)
    return _keyed_data(where, data)


def _keyed_data(where: tuple[str, Any], data: ItemData) -> tuple[Hashable, bytes | None]:
    """(key, hash) of an item at `where` (DCP's fqn and offset) holding `data`: the key is
    `where` plus the tensor kind ("bytes" for a byte item), the hash the xxh3-128 of its
    bytes; a tensor `tensor_kind` refuses has no hash (never unchanged)."""
    if not isinstance(data, torch.Tensor):
        return (*where, "bytes"), bytes_digest(data)
    kind = tensor_kind(data)
    if kind is None:
        return (*where, None), None
    return (*where, kind), tensor_digest(data)


def _likely_frozen(fqns: list[str]) -> set[str]:
    """The model entries (`model.<param>`) the optimizer holds no state or parameter-group
    entry for (`optim.state.<param>.<name>`, `optim.param_groups.<param>.<name>`): likely
    frozen, so they start in files of their own before any hash says so. Empty without an
    optimizer (nothing to tell by)."""
    optimized = {
        fqn.split(".", 2)[2].rsplit(".", 1)[0]
        for fqn in fqns
        if fqn.startswith(("optim.state.", "optim.param_groups.")) and fqn.count(".") >= 3
    }
    if not optimized:
        return set()
    return {
        fqn
        for fqn in fqns
        if fqn.startswith("model.") and fqn.removeprefix("model.") not in optimized
    }
